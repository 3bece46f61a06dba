"""Loading a ``Config``: defaults, then a YAML file, then ``--section.key value`` overrides, each
key checked (a typo gets a did-you-mean, a moved key names its new place), then saving it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_origin

import yaml

from turnrl.config.renames import check_not_moved, moved_key_error, translate_stored
from turnrl.config.root import Config, sections
from turnrl.config.types import ConfigError, did_you_mean, parse_yaml_value, type_hints


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in sections().items() for f in dataclasses.fields(cls)]


def _closest_key(key: str) -> str:
    """Typo in the field name first, then the same field in another section, then any key."""
    section, _, name = key.partition(".")
    if section in sections():
        names = [f.name for f in dataclasses.fields(sections()[section])]
        if match := difflib.get_close_matches(name, names, n=1):
            return f"; did you mean '{section}.{match[0]}'?"
    moved = [k for k in _all_keys() if k.endswith(f".{name}")]
    # A high cutoff: the shared 'section.' prefix alone makes unrelated keys look similar.
    return did_you_mean(key, moved, cutoff=0) or did_you_mean(key, _all_keys(), cutoff=0.8)


def _unknown_key(key: str) -> ConfigError:
    if moved := moved_key_error(key):
        return moved
    hint = _closest_key(key)
    section = key.split(".")[0]
    if not hint and section in sections():
        names = ", ".join(f.name for f in dataclasses.fields(sections()[section]))
        hint = f"; valid keys in '{section}': {names}"
    elif not hint:
        hint = f"; valid sections: {', '.join(sections())}"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _apply(tree: dict, key: str, value: Any) -> None:
    """Set dotted ``key`` in the nested ``tree``; keys below a dict field set entries inside it."""
    section, _, rest = key.partition(".")
    name, _, sub = rest.partition(".")
    cls = sections().get(section)
    if cls is None or name not in type_hints(cls):
        raise _unknown_key(key)
    if not sub:
        tree[section][name] = value
        return
    if get_origin(type_hints(cls)[name]) is not dict:
        raise _unknown_key(key)
    *parents, leaf = sub.split(".")
    target = tree[section][name]
    for part in parents:
        target = target.setdefault(part, {}) if isinstance(target, dict) else None
    if not isinstance(target, dict):
        raise ConfigError(f"{key}: the parent is not a mapping; set the whole dict instead")
    target[leaf] = value


def _merge(tree: dict, data: Any, origin: str) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{origin} must be a mapping of sections (e.g. 'algo: {{clip_high: 0.28}}'), "
            f"got {type(data).__name__}"
        )
    check_not_moved(data)
    for section, values in data.items():
        if section not in sections():
            hint = did_you_mean(str(section), list(sections())) or (
                f"; valid sections: {', '.join(sections())}"
            )
            raise ConfigError(f"unknown config section '{section}'{hint}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"config section '{section}' must be a mapping, got {values!r}")
        for name, value in values.items():
            _apply(tree, f"{section}.{name}", value)


def _parse_overrides(args: Sequence[str]) -> list[tuple[str, str]]:
    """``--a.b v``, ``--a.b=v`` and ``a.b=v`` become ``(key, raw string)`` pairs."""
    pairs, i = [], 0
    while i < len(args):
        arg, i = args[i], i + 1
        key = arg.removeprefix("--")
        if "=" in key:
            key, value = key.split("=", 1)
        elif arg.startswith("--") and i < len(args) and not args[i].startswith("--"):
            value, i = args[i], i + 1
        else:
            raise ConfigError(f"--{key} needs a value")
        pairs.append((key, value))
    return pairs


def _build(tree: Mapping[str, Mapping[str, Any]]) -> Config:
    return Config(**{name: cls(**tree[name]) for name, cls in sections().items()})


def _read_yaml(path: str) -> Any:
    if not Path(path).is_file():
        raise ConfigError(f"config file '{path}' not found; check the path")
    try:
        return yaml.safe_load(Path(path).read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:  # YAML's text spans lines: one here
        what = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ConfigError(f"config file '{path}' is not valid YAML ({what}); fix it") from None


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file at ``path``, then command-line ``overrides``."""
    tree = config_to_dict(Config())
    if path:
        _merge(tree, _read_yaml(path), f"config file '{path}'")
    _apply_overrides(tree, overrides)
    return _build(tree)


def _apply_overrides(tree: dict, overrides: Sequence[str]) -> None:
    for key, value in _parse_overrides(overrides):
        # Entries inside a dict field have no declared type, so let YAML type them (20 -> int).
        _apply(tree, key, parse_yaml_value(value) if key.count(".") >= 2 else value)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def changed_keys(old: Config, new: Config) -> list[str]:
    """Dotted keys whose values differ between two configs."""
    a, b = config_to_dict(old), config_to_dict(new)
    return [f"{section}.{key}" for section in a for key in a[section]
            if a[section][key] != b[section][key]]


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Rebuild a stored config (e.g. on resume) with the same checks as ``load_config``; keys
    that have moved since it was written are read at their new place."""
    tree = config_to_dict(Config())
    _merge(tree, translate_stored(data), "config")
    return _build(tree)


def load_run_config(path: str, overrides: Sequence[str] = ()) -> Config:
    """A run directory's stored ``config.yaml`` (old keys translated), then ``overrides``
    (checked as on the command line)."""
    tree = config_to_dict(Config())
    _merge(tree, translate_stored(_read_yaml(path)), f"stored config '{path}'")
    _apply_overrides(tree, overrides)
    return _build(tree)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: a kill mid-write must not leave a truncated config for --resume.
    tmp = Path(path).with_suffix(".yaml.tmp")
    with open(tmp, "w") as f:
        f.write(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
