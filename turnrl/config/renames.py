"""Config keys that moved: an old key given by a person fails with one line naming the new key;
a run directory's stored ``config.yaml`` written with old keys is translated on reading.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from turnrl.config.types import ConfigError

MOVED: dict[str, str] = {
    # the critic settings, once split between algo and credit
    "algo.gamma": "critic.gamma",
    "algo.gae_lambda": "critic.gae_lambda",
    "algo.gigpo_step_weight": "critic.gigpo_step_weight",
    "algo.critic_lr": "critic.lr",
    "algo.critic_tau": "critic.tau",
    "algo.critic_updates": "critic.updates",
    "algo.replay_episodes": "critic.replay_episodes",
    "credit.warmup_updates": "critic.warmup_updates",
    "credit.warmup_max_error": "critic.warmup_max_error",
    "credit.scale": "critic.scale",
    "credit.critic_features": "critic.features",
    "credit.gigpo_episode_weight": "critic.gigpo_episode_weight",
    # pool sizing, once under staleness
    "staleness.overprovision": "pool.overprovision",
    "staleness.queued_groups": "pool.queued_groups",
    "staleness.auto": "pool.auto",
    "staleness.pool_memory_fraction": "pool.memory_fraction",
    # one switch picks the rollout source for turnrl train and train_agent alike
    "serve.train_mode": "run.mode",
    # one key chooses the sampler in every mode; the rest tune it (the sampler section)
    "rollout.engine": "rollout.sampler",
    "rollout.engine_dtype": "rollout.sampler_dtype",
    "rollout.matmul": "sampler.matmul",
    "rollout.reuse_cache": "sampler.reuse_cache",
    "ray.gpu_memory_utilization": "sampler.gpu_memory_utilization",
    "staleness.keep_kv_cache": "sampler.keep_kv_cache",
}
"""Old dotted key -> its new one."""

OLD_VALUE_WINS = {"serve.train_mode": "sync"}
"""Old keys whose stored value overrides the new key's unless it is this default (a served
run trained in async mode was stored with ``run.mode: sync`` beside ``train_mode: async``)."""

WORKER_SAMPLER: dict[str, str] = {"ray.engine": "rollout.sampler",
                                  "ray.engine_dtype": "rollout.sampler_dtype"}
"""Async workers' old sampler keys: a stored async run's values become the one key's (a sync
run never read them, so its ``rollout.*`` values stay)."""

REMOVED_SECTIONS = ("credit",)
"""Sections whose every key moved (a stored config may hold them whole)."""


def moved_key_error(key: str) -> ConfigError | None:
    """The one-line error for an old key (``critic.gamma``, ``critic.scale.x``), else None."""
    section, _, rest = key.partition(".")
    name = rest.split(".")[0]
    new = MOVED.get(f"{section}.{name}") or WORKER_SAMPLER.get(f"{section}.{name}")
    if new is None:
        return None
    return ConfigError(f"config key '{section}.{name}' moved to '{new}'; write --{new} "
                       f"(YAML: {new.split('.')[0]}: {{{new.split('.')[1]}: ...}})")


def check_not_moved(data: Mapping[str, Any]) -> None:
    """Refuse old keys in a mapping of sections (a YAML file a person wrote)."""
    for section, values in data.items():
        if isinstance(values, Mapping):
            for name in values:
                if error := moved_key_error(f"{section}.{name}"):
                    raise error


def translate_stored(data: Any) -> Any:
    """A stored config with old keys rewritten to the new ones (a copy; non-mappings as is).

    A key present under both names keeps the new one's value (the newer writer's)."""
    if not isinstance(data, Mapping):
        return data
    out = {section: dict(values) if isinstance(values, Mapping) else values
           for section, values in copy.deepcopy(dict(data)).items()}
    for old, new in MOVED.items():
        if (taken := _take(out, old, new)) is None:
            continue
        value, target, new_name = taken
        target.setdefault(new_name, value)
        if old in OLD_VALUE_WINS and value != OLD_VALUE_WINS[old]:
            target[new_name] = value
    _worker_sampler(out)
    for section in REMOVED_SECTIONS:
        if out.get(section) == {}:
            del out[section]
    return out


def _worker_sampler(out: dict) -> None:
    """``ray.engine`` and ``ray.engine_dtype`` popped from ``out``; in an async run whose
    workers sampled with vllm or ct2 their values replace ``rollout.sampler`` and its dtype
    (ray.engine hf workers sampled with rollout.engine's HF engine, in rollout.engine_dtype)."""
    run, ray = out.get("run"), out.get("ray")
    workers = ray.get("engine", "hf") if isinstance(ray, dict) else "hf"
    replaces = isinstance(run, dict) and run.get("mode") == "async" and workers != "hf"
    for old, new in WORKER_SAMPLER.items():
        if (taken := _take(out, old, new)) is not None and replaces:
            value, target, new_name = taken
            target[new_name] = value


def _take(out: dict, old: str, new: str) -> tuple[Any, dict, str] | None:
    """Pop the stored key ``old`` (``section.name``) from ``out``: (its value, the section
    ``new`` goes in, created if missing, ``new``'s name); None when ``old`` is not there or
    the new section is not a mapping."""
    old_section, old_name = old.split(".")
    values = out.get(old_section)
    if not isinstance(values, dict) or old_name not in values:
        return None
    value = values.pop(old_name)
    new_section, new_name = new.split(".")
    target = out.setdefault(new_section, {})
    return (value, target, new_name) if isinstance(target, dict) else None
