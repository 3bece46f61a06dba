"""What the training benchmarks share: one TurnRL training job's config keys, and its
steady-state rate read back from its metrics.

``step_throughput.py``, ``async_throughput.py``, ``ct2_async.py`` and ``cluster_nodes.py``
each run the same kind of job (a model, an env, G completions x P groups a step, T tokens a
turn, a seed; no evaluation, checkpoints, progress bar, TensorBoard or collapse monitor inside
the timed run):
``job_keys`` names it once, as dotted config keys, and each script adds its own keys and
hands them to TurnRL as command-line overrides (``overrides``) or a config (``config``).
Not a benchmark itself: imported by the scripts of this folder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def job_keys(model: str, env: str, *, group_size: int, groups_per_step: int,
             max_new_tokens: int | None = None, seed: int = 0,
             env_options: Mapping | None = None,
             max_turns: int | None = None, lr: float | None = None,
             threads: int | None = None) -> dict[str, Any]:
    """The dotted config keys of a benchmark's training job (a None leaves the default)."""
    keys: dict[str, Any] = {
        "model.name": model, "env.name": env, "rollout.group_size": group_size,
        "rollout.groups_per_step": groups_per_step, "run.seed": seed, "eval.episodes": 0, "run.checkpoint_every": 0,
        "run.progress": False, "run.tensorboard": False,
        "run.collapse_every": 0}  # a monitor TRL's step does not run: like for like
    optional = {"rollout.max_new_tokens": max_new_tokens,
                "env.options": dict(env_options) if env_options else None,
                "rollout.max_turns": max_turns, "optim.lr": lr, "run.threads": threads}
    keys.update({key: value for key, value in optional.items() if value is not None})
    return keys


def overrides(keys: Mapping[str, Any]) -> list[str]:
    """``--key=value`` arguments of ``keys`` for ``turnrl train`` or ``load_config`` (a
    mapping as JSON, a bool as true/false)."""
    def text(value: Any) -> str:
        if isinstance(value, Mapping):
            return json.dumps(value)
        return str(value).lower() if isinstance(value, bool) else str(value)
    return [f"--{key}={text(value)}" for key, value in keys.items()]


def config(keys: Mapping[str, Any]):
    """The TurnRL ``Config`` of ``keys`` (typed values kept as they are)."""
    from turnrl.config import config_from_dict

    tree: dict[str, dict[str, Any]] = {}
    for key, value in keys.items():
        section, name = key.split(".", 1)
        tree.setdefault(section, {})[name] = value
    return config_from_dict(tree)


def steady_rate(records: Sequence[Mapping[str, Any]], key: str, per_step: int,
                time_key: str = "time") -> float:
    """``key`` x ``per_step`` a second from the end of the first step to the end of the last
    (start-up and the pipeline's fill left out): a metrics.jsonl's per-episode mean times the
    episodes a step, over steps 2..n."""
    later = records[1:]
    seconds = records[-1][time_key] - records[0][time_key]
    return sum(r[key] for r in later) * per_step / seconds
