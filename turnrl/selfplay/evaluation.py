"""What evaluation plays for a game trained against the policy itself or its pool (each
fixed opponent the game names), the outside player an env with no fixed opponents keeps in
evaluation (a simulated user), and the per-role outcomes it adds to its result."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from turnrl.envs import Env, make_env
from turnrl.envs.contract import eval_options, seats, uses_pool
from turnrl.evaluation import EvalResult
from turnrl.selfplay.endpoint import EndpointOpponent
from turnrl.selfplay.opponents import ModelOpponent
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


_PLAYERS: dict[tuple, ModelOpponent | EndpointOpponent] = {}
"""Outside players evaluation has loaded in this process, by what they were loaded from."""


def outside_player(cfg: Any) -> ModelOpponent | EndpointOpponent:
    """The run's outside player (``opponent: model`` or ``endpoint``) for evaluation, loaded
    once per process: the training source builds its own (``trainer/local.py``, a worker's
    ``worker_env_factory``) from the same settings, so evaluation meets the same user."""
    env, rollout = cfg.env, cfg.rollout
    kind = cfg.env.outside_opponent()
    key = (kind, env.opponent_model, env.opponent_endpoint, env.opponent_endpoint_model,
           cfg.model.dtype, rollout.max_new_tokens, rollout.temperature, rollout.top_p,
           cfg.run.seed)
    if key not in _PLAYERS:
        _PLAYERS[key] = (ModelOpponent.load(env.opponent_model, cfg) if kind == "model"
                         else EndpointOpponent.from_config(cfg))
    return _PLAYERS[key]


def with_outside_player(make: Callable[[], Env], cfg: Any) -> Callable[[], Env]:
    """``make`` with the run's outside player handed to each env when evaluation still plays
    it: the env's options name ``opponent: model`` or ``endpoint`` (a simulated user; a game
    is evaluated against its fixed ``eval_opponents`` instead, which need no player)."""
    options = getattr(make, "keywords", None) or {}
    if options.get("opponent") not in ("model", "endpoint"):
        return make
    return outside_player(cfg).attach(make)
