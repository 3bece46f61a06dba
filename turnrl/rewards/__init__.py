"""Verifiable reward functions: plain functions of the reply text returning ``float | None``.

``None`` means "cannot be judged" (for example no answer found) where a caller wants to
tell that apart from a wrong answer; the built-in tasks treat it as 0.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


def first_integer(text: str) -> int | None:
    """The first integer written in ``text``, or None."""
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


def last_integer(text: str) -> int | None:
    """The last integer written in ``text``, or None."""
    matches = _INTEGER.findall(text)
    return int(matches[-1]) if matches else None


def integer_match(text: str, answer: int, which: str = "last") -> float:
    """1.0 when the chosen integer of ``text`` equals ``answer``, else 0.0.

    ``which``: "first", "last", or "only" (the reply must be just the number).
    """
    if which == "only":
        stripped = text.strip().rstrip(".")
        value = int(stripped) if re.fullmatch(r"-?\d+", stripped) else None
    elif which in ("first", "last"):
        value = first_integer(text) if which == "first" else last_integer(text)
    else:
        raise ValueError(f"unknown integer parse '{which}'; use first, last or only")
    return 1.0 if value == answer else 0.0
