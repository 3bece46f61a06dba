"""Turning config values into their annotated types, with one-line errors; the base of every
section.

Kept apart from the sections so they read as the lists of options they are.
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import inspect
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the problem and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))  # multi-line messages hide in logs


def did_you_mean(word: str, candidates: Sequence[str], cutoff: float = 0.6) -> str:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=cutoff)
    return f"; did you mean '{match[0]}'?" if match else ""



_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation, in declaration order."""
    return get_type_hints(cls)


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | str) and str(value).strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[str(value).strip().lower()]
    raise ValueError


def _plain(value: Any, *types: type) -> Any:
    """``value`` if it is one of ``types``; bool never passes (it is an int subclass)."""
    if isinstance(value, bool) or not isinstance(value, types):
        raise TypeError
    return value


def _to_dict(value: Any) -> dict:
    if isinstance(value, str):
        value = parse_yaml_value(value)
    if not isinstance(value, Mapping):
        raise TypeError
    return copy.deepcopy(dict(value))


def _to_list(value: Any) -> list:
    if isinstance(value, str):
        value = parse_yaml_value(value)
    if not isinstance(value, list | tuple):
        raise TypeError
    return copy.deepcopy(list(value))


_SCALARS = {
    bool: _to_bool,
    int: lambda v: int(_plain(v, int, str)),  # a float like 1.5 must not silently truncate
    float: lambda v: float(_plain(v, int, float, str)),  # also parses '1e-5', a YAML 1.1 string
    str: lambda v: str(_plain(v, int, float, str)),  # YAML reads `out_dir: 2024` as an int
    dict: _to_dict,
    list: _to_list,
}


def convert_value(key: str, value: Any, tp: Any) -> Any:
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        hint = did_you_mean(str(value), [str(c) for c in choices])
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}{hint}")
    base = get_origin(tp) or tp
    try:
        return _SCALARS[base](value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {base.__name__}, got {value!r}") from None


def parse_yaml_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse {text!r} as YAML ({exc}); quote or fix it") from None


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of ``cls``: the string literal right after each annotated field."""
    return dict(_field_docs(cls))  # a copy, so callers cannot corrupt the cache


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            if isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "{" + ",".join(get_args(tp)) + "}"
    return (get_origin(tp) or tp).__name__.upper()


class Section:
    """Base of every section: converts fields to their annotated types, then checks ranges."""

    def __post_init__(self) -> None:
        for name, tp in type_hints(type(self)).items():
            value = convert_value(self._key(name), getattr(self, name), tp)
            object.__setattr__(self, name, value)  # frozen, so bypass __setattr__
        self._check()

    def _check(self) -> None:
        """Range checks; sections override this."""

    def _key(self, name: str) -> str:
        """Dotted key of field ``name``, e.g. 'algo.clip_high' (RolloutConfig -> 'rollout')."""
        return f"{type(self).__name__.removesuffix('Config').lower()}.{name}"

    def _require(self, name: str, ok: bool, rule: str) -> None:
        if not ok:
            raise ConfigError(f"{self._key(name)} must be {rule}, got {getattr(self, name)!r}")

    def _at_least(self, low: float, *names: str) -> None:
        for name in names:
            self._require(name, getattr(self, name) >= low, f">= {low}")
