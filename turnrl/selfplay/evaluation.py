"""What evaluation plays for a game trained against the policy itself or its pool (each
fixed opponent the game names), and the per-role outcomes it adds to its result."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from turnrl.envs import Env, make_env
from turnrl.envs.contract import eval_options, seats, uses_pool
from turnrl.evaluation import EvalResult
from turnrl.selfplay.outcomes import outcome_metrics
from turnrl.types import Episode


def with_outcome_metrics(result: EvalResult, episodes: Sequence[Episode]) -> EvalResult:
    """``result`` with each role's win/draw/loss rates and intervals (``outcome_metrics``,
    per opponent when evaluation played several) added to its ``env_metrics``: logged as
    ``eval/...`` and saved with the before/after results. Unchanged for episodes without
    roles."""
    table = outcome_metrics(episodes)
    if not table:
        return result
    return dataclasses.replace(result, env_metrics={**(result.env_metrics or {}), **table})


def evaluation_factories(name: str, options: dict[str, Any], env: Any
                         ) -> dict[str, Callable[[], Env]]:
    """What evaluation plays for an env trained against ``self`` or a ``pool``: the same game
    against each fixed opponent it names in ``eval_opponents``, labelled ``NAME@OPPONENT``
    (the policy's own moving copies are no fixed yardstick); any other env: itself. Either
    with the env's ``eval_options`` (envs/contract.py)."""
    opponents = getattr(env, "eval_opponents", ())
    options = {**options, **eval_options(env)}  # a dataset's held-out split
    if not (seats(env) or uses_pool(options)) or not opponents:
        return {name: partial(make_env, name, **options)}
    return {f"{name}@{opponent}": partial(make_env, name, **{**options, "opponent": opponent})
            for opponent in opponents}
