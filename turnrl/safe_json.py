"""Make whatever an environment returns safe to keep in an episode and write as JSON.

An env's ``info`` is free-form user data, copied into ``Episode.info`` and written to the
episode files. Before this module an object JSON cannot write (a set, bytes, a tensor, a
custom class) crashed the run while the file was being written, and a huge list or string
was kept whole. ``json_safe`` turns any value into plain JSON data, at the point it enters
the episode, under a size budget:

- ``None``, ``bool``, ``int``, ``str`` stay (a string longer than ``max_chars`` is cut, with
  a marker saying how much was left out); a finite ``float`` stays, NaN and infinities
  become ``None`` (JSON has neither; ``metrics.jsonl`` does the same);
- dicts, lists, tuples and sets become dicts and lists (keys as strings; a set sorted by
  its items' text, so a file does not depend on hash order), at most ``max_items`` entries
  each and ``max_depth`` levels deep, with a marker for what was left out; a container
  that contains itself becomes ``"<cycle: dict>"``;
- numpy scalars, numpy arrays and torch tensors become numbers and lists (a big array
  becomes ``"<ndarray shape=(...) dtype=...>"``); bytes become ``"<bytes: N>"`` with a
  preview;
- anything else becomes ``"<TypeName: repr>"``, its ``repr`` bounded; an object whose
  ``repr`` raises becomes ``"<TypeName: repr raised ValueError>"``.

Nothing here raises: ``json.dumps(json_safe(x))`` always succeeds and is bounded in size.

``dumps`` is the ``json.dumps`` every file TurnRL writes goes through: non-finite floats
become ``null`` there too, so each file parses with a strict JSON reader.
"""

from __future__ import annotations

import json
import math
from typing import Any

USER_ERRORS = (Exception, GeneratorExit, SystemExit)
"""What code of a user's (an env, its values' ``__str__``, ``__repr__``, ``__bool__``) may raise
that is that code's own failure, to be caught and named: every exception but
``KeyboardInterrupt`` (Ctrl-C must still stop the run) and asyncio's ``CancelledError`` (the
loop's own). A ``SystemExit`` or ``GeneratorExit`` from an env is its bug, not a request to
stop the run."""

MAX_CHARS = 10_000
"""Longest string kept whole (an info value, an error message)."""
MAX_ITEMS = 1_000
"""Most entries kept of one list, dict or set."""
MAX_DEPTH = 12
"""Deepest nesting kept."""
MAX_TOTAL_CHARS = 200_000
"""Budget of one ``json_safe`` call (one step's info): strings and entries past it are cut,
so the JSON of one step's info stays near this many characters."""


def cut(text: str, max_chars: int = MAX_CHARS) -> str:
    """``text`` whole when short enough, else its start and how much was left out."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}...[{len(text) - max_chars} more chars]"


def safe_text(value: Any, max_chars: int = MAX_CHARS) -> str:
    """``str(value)``, bounded; never raises (an object whose ``__str__`` raises is named)."""
    try:
        text = value if isinstance(value, str) else str(value)
    except USER_ERRORS as err:  # user objects may raise anything here
        text = f"<{type(value).__name__}: str raised {type(err).__name__}>"
    return cut(text, max_chars)


def safe_repr(value: Any, max_chars: int = 200) -> str:
    """``repr(value)``, bounded; never raises."""
    try:
        text = repr(value)
    except USER_ERRORS as err:  # user objects may raise anything here
        return f"<{type(value).__name__}: repr raised {type(err).__name__}>"
    return cut(text, max_chars)


class _Budget:
    """Characters left for one ``json_safe`` call."""

    def __init__(self, chars: int) -> None:
        self.chars = chars

    def take(self, text: str) -> str:
        kept = cut(text, max(0, min(MAX_CHARS, self.chars)))
        self.chars -= len(kept)
        return kept


def json_safe(value: Any, max_total_chars: int = MAX_TOTAL_CHARS) -> Any:
    """``value`` as plain JSON data (see the module docstring); never raises."""
    return _safe(value, _Budget(max_total_chars), (), 0)


def _safe(value: Any, budget: _Budget, path: tuple[int, ...], depth: int) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**63 else budget.take(str(value))  # JSON readers: i64
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return budget.take(value)
    if budget.chars <= 0:
        return "<left out: info too large>"
    if isinstance(value, dict | list | tuple | set | frozenset):
        if id(value) in path:
            return f"<cycle: {type(value).__name__}>"
        if depth >= MAX_DEPTH:
            return f"<{type(value).__name__}: nested over {MAX_DEPTH} levels>"
        return _container(value, budget, (*path, id(value)), depth + 1)
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return budget.take(f"<bytes: {len(data)}> {safe_repr(data[:64], 300)}")
    if _many_elements(value):  # its shape, without copying it (off a GPU, say)
        dtype = str(getattr(value, "dtype", "?")).removeprefix("torch.")
        return budget.take(f"<{type(value).__name__} shape={tuple(value.shape)} "
                           f"dtype={dtype}>")
    array = _as_array(value)
    if array is not None and array.dtype.kind in "biufU":  # numbers or text
        return _array(array, type(value).__name__, budget, path, depth)
    text = safe_repr(value)
    if not text.startswith(f"<{type(value).__name__}: repr raised"):
        text = f"<{type(value).__name__}: {text}>"
    return budget.take(text)


def _container(value: Any, budget: _Budget, path: tuple[int, ...], depth: int) -> Any:
    try:
        items = list(value.items()) if isinstance(value, dict) else list(value)
    except USER_ERRORS as err:  # a subclass may break iteration
        return f"<{type(value).__name__}: iteration raised {type(err).__name__}>"
    left_out = max(0, len(items) - MAX_ITEMS)
    items = items[:MAX_ITEMS]
    if isinstance(value, dict):
        out: Any = {}
        for key, item in items:
            if budget.chars <= 0:
                left_out += 1
                continue
            name = key if isinstance(key, str) else safe_text(key, 200)
            out[budget.take(name)] = _safe(item, budget, path, depth)
        if left_out:
            out["<left out>"] = f"{left_out} more entries"
        return out
    if isinstance(value, set | frozenset):
        items = sorted(items, key=safe_repr)
    out = []
    for item in items:
        if budget.chars <= 0:
            left_out += 1
            continue
        out.append(_safe(item, budget, path, depth))
    if left_out:
        out.append(f"<left out: {left_out} more items>")
    return out


def _many_elements(value: Any) -> bool:
    """A numpy array or torch tensor of over ``MAX_ITEMS`` elements."""
    module = type(value).__module__ or ""
    if not (module.startswith("numpy") or module.startswith("torch")):
        return False
    try:
        count = value.numel() if module.startswith("torch") else value.size
        return int(count) > MAX_ITEMS and hasattr(value, "shape")
    except Exception:  # noqa: BLE001 - not an array after all
        return False


def _as_array(value: Any) -> Any:
    """A numpy array for numpy scalars/arrays and torch tensors; else None."""
    module = type(value).__module__ or ""
    if not (module.startswith("numpy") or module.startswith("torch")):
        return None
    try:
        import numpy as np

        if module.startswith("torch"):
            value = value.detach().cpu()
            value = (value.float() if value.is_floating_point() else value).numpy()
        return np.asarray(value)
    except Exception:  # noqa: BLE001 - an odd tensor type: named by type instead
        return None


def _array(array: Any, name: str, budget: _Budget, path: tuple[int, ...], depth: int) -> Any:
    return _safe(array.tolist(), budget, path, depth)


def finite_json(value: Any) -> Any:
    """``value`` with every NaN and infinity (in dicts, lists and tuples, at any depth)
    replaced by ``None``; other values are kept as they are (no copy when none is found)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(item) for item in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` that always writes valid JSON: JSON has no NaN or Infinity (Python's
    ``json`` would write the non-standard ``NaN``/``-Infinity``, which strict readers refuse),
    so non-finite floats are written as ``null``. Every file TurnRL writes goes through this
    (or ``metrics.jsonl``'s logger, which does the same)."""
    try:
        return json.dumps(value, allow_nan=False, **kwargs)
    except ValueError:  # a NaN or infinity somewhere: the slow path, only then
        return json.dumps(finite_json(value), allow_nan=False, **kwargs)
