"""Weighted sums of reward functions: ``combine([(math_answer, 1.0), (format_reward, 0.1)])``."""

from __future__ import annotations

import inspect
from collections.abc import Callable


def _accepts(fn: Callable) -> Callable[[dict], dict]:
    """Pick, from the task's facts, the keyword arguments ``fn`` takes (all with **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return lambda facts: facts
    names = {p.name for p in params}
    return lambda facts: {k: v for k, v in facts.items() if k in names}


def combine(parts: list[tuple[Callable, float]]) -> Callable:
    """One reward function from ``(fn, weight)`` pairs; each ``fn(completion, **facts)`` is
    given the facts it names (e.g. ``answer``, ``tests``).

    A component returning None ("cannot judge") adds 0; the sum is None only when every
    component returned None. If any component is ``async``, so is the result.
    """
    if not parts:
        raise ValueError("combine needs at least one (reward function, weight) pair")
    for fn, weight in parts:
        if not callable(fn) or isinstance(weight, bool) or not isinstance(weight, int | float):
            raise TypeError(f"combine takes (function, weight) pairs, got ({fn!r}, {weight!r})")
    pickers = [(fn, float(w), _accepts(fn)) for fn, w in parts]

    def total(values: list[float | None]) -> float | None:
        if all(v is None for v in values):
            return None
        return sum(w * v for (_, w, _), v in zip(pickers, values, strict=True) if v is not None)

    if any(inspect.iscoroutinefunction(fn) for fn, _ in parts):
        async def combined_async(completion: str, **facts) -> float | None:
            values = []
            for fn, _, pick in pickers:
                value = fn(completion, **pick(facts))
                values.append(await value if inspect.isawaitable(value) else value)
            return total(values)
        return combined_async

    def combined(completion: str, **facts) -> float | None:
        return total([fn(completion, **pick(facts)) for fn, _, pick in pickers])
    return combined
