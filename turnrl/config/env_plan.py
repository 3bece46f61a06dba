"""The shape of ``env.curriculum`` and ``env.mix``: parsed into small typed records, each
mistake a one-line ``ConfigError`` (docs/curriculum.md).

Only the shape is checked here (the config layer knows no environments); that the envs exist
and accept the options is checked when the policy builds them (``turnrl.policy``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from turnrl.config.types import ConfigError

CURRICULUM_KEYS = ("option", "levels", "band", "window")
MIX_KEYS = ("name", "options", "weight", "label")
DEFAULT_BAND = (0.3, 0.8)
DEFAULT_WINDOW = 2
MIX_NAME = "mix"
"""``env.name`` of a run that mixes the envs of ``env.mix``."""
OUTSIDE_OPPONENTS = ("pool", "model", "endpoint")
"""``opponent`` values whose player the trainer builds and hands over (turnrl/selfplay/)."""


@dataclass(frozen=True)
class Curriculum:
    """A difficulty knob: ``option`` of the env takes ``levels[i]``, easy to hard."""

    option: str
    levels: tuple[Any, ...]
    band: tuple[float, float] = DEFAULT_BAND
    """Target training success [low, high]: above high the level goes up, below low down."""
    window: int = DEFAULT_WINDOW
    """Steps at a level whose mean success decides a move (then a fresh window starts)."""


@dataclass(frozen=True)
class MixEntry:
    """One environment of a mix, drawn for a group with probability weight / sum(weights)."""

    name: str
    options: dict
    weight: float
    label: str
    """What its metrics and evaluation rows are called (default: the env name)."""


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _yaml_number(value: Any) -> Any:
    """A number written in a form YAML 1.1 reads as text (``1e3``, ``1.0e308``: an exponent
    needs a dot and a sign there) as the number it spells; anything else as it is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _unknown_keys(where: str, given: Mapping, valid: tuple[str, ...]) -> None:
    extra = [str(k) for k in given if k not in valid]
    if extra:
        hint = " (YAML needs a space after the colon: 'name: value')" if ":" in extra[0] else ""
        raise ConfigError(f"{where}: unknown key '{extra[0]}'{hint}; valid keys: "
                          f"{', '.join(valid)}")


def parse_curriculum(raw: Mapping[str, Any]) -> Curriculum | None:
    """``env.curriculum`` as a ``Curriculum`` (None when empty: no curriculum)."""
    if not raw:
        return None
    _unknown_keys("env.curriculum", raw, CURRICULUM_KEYS)
    option = raw.get("option")
    if not isinstance(option, str) or not option:
        raise ConfigError("env.curriculum.option must name the env option the levels set, "
                          f"e.g. --env.curriculum.option high; got {option!r}")
    levels = raw.get("levels")
    if not isinstance(levels, list | tuple) or not levels:
        raise ConfigError("env.curriculum.levels must be a non-empty list of values, easy to "
                          f"hard, e.g. --env.curriculum.levels '[10, 100, 1000]'; got {levels!r}")
    band = raw.get("band", list(DEFAULT_BAND))
    if isinstance(band, list | tuple):
        band = [_yaml_number(edge) for edge in band]
    if (not isinstance(band, list | tuple) or len(band) != 2 or not all(map(_number, band))
            or not 0 <= band[0] < band[1] <= 1):
        raise ConfigError("env.curriculum.band must be [low, high] with 0 <= low < high <= 1 "
                          f"(target training success), e.g. [0.3, 0.8]; got {band!r}")
    window = raw.get("window", DEFAULT_WINDOW)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError("env.curriculum.window must be a whole number of steps >= 1; "
                          f"got {window!r}")
    return Curriculum(option, tuple(levels), (float(band[0]), float(band[1])), window)


def parse_mix(raw: list) -> tuple[MixEntry, ...]:
    """``env.mix`` as ``MixEntry`` records (empty: one env, ``env.name``)."""
    entries = tuple(_mix_entry(i, item) for i, item in enumerate(raw))
    if not math.isfinite(sum(e.weight for e in entries)):  # the draw divides by the sum
        raise ConfigError("env.mix: the weights sum past the largest float; only their ratios "
                          "matter, so scale them down (e.g. 3 and 1)")
    labels = [e.label for e in entries]
    repeated = next((label for label in labels if labels.count(label) > 1), None)
    if repeated is not None:
        raise ConfigError(f"env.mix: '{repeated}' appears twice; give each entry its own label "
                          "(e.g. {name: guess-number, options: {high: 100}, label: guess-100})")
    return entries


def _mix_entry(index: int, item: Any) -> MixEntry:
    where = f"env.mix[{index}]"
    if not isinstance(item, Mapping):
        raise ConfigError(f"{where} must be a mapping {{name, options, weight}}, got {item!r}")
    _unknown_keys(where, item, MIX_KEYS)
    name, options = item.get("name"), item.get("options", {}) or {}
    weight, label = _yaml_number(item.get("weight", 1.0)), item.get("label", name)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name must be a registered environment name, got {name!r}")
    if not isinstance(options, Mapping):
        raise ConfigError(f"{where}.options must be a mapping of constructor options, "
                          f"got {options!r}")
    if not _number(weight) or not 0 < weight < math.inf:
        raise ConfigError(f"{where}.weight must be a finite number > 0, got {weight!r}; every "
                          "entry needs a positive weight (drop an entry to leave it out)")
    if not isinstance(label, str) or not label or "/" in label:
        raise ConfigError(f"{where}.label must be a non-empty name without '/', got {label!r}")
    return MixEntry(name, dict(options), float(weight), label)


@dataclass(frozen=True)
class EnvModule:
    """``env.module`` parsed: what to import, and the env it names (``module:NAME``)."""

    target: str
    """A module name (``my_envs``, ``pkg.envs``) or the path of a ``.py`` file."""
    env: str = ""
    """The env ``module:NAME`` picks ('' = env.name picks it)."""

    @property
    def is_path(self) -> bool:
        return self.target.endswith(".py") or "/" in self.target or "\\" in self.target


def parse_env_module(spec: str) -> EnvModule | None:
    """``env.module``: ``my_envs``, ``my_envs:NAME``, ``path/to/envs.py`` or
    ``path/to/envs.py:NAME`` (None: no module)."""
    if not spec.strip():
        return None
    target, colon, env = spec.strip().rpartition(":")
    if not colon or not target or "/" in env or "\\" in env or env.endswith(".py"):
        target, env = spec.strip(), ""  # no ':NAME' part (a Windows drive letter stays)
    module = EnvModule(target, env)
    if not module.is_path and not all(p.isidentifier() for p in target.split(".")):
        raise ConfigError(f"env.module '{spec}' is neither a module name (my_envs, pkg.envs) "
                          "nor a .py file path; give one, optionally followed by :ENV_NAME")
    return module
