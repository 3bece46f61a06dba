"""Weighted sums of reward functions: ``combine([(math_answer, 1.0), (format_reward, 0.1)])``."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from turnrl.safe_json import safe_repr
from turnrl.types import finite_real


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
    component returned None. If any component is ``async``, so is the result. A weight that
    is not a finite number is refused here; a component returning anything but a finite
    number or None raises ``ValueError`` naming it (inside an env's step: that episode fails
    with the reason), as does a sum past float's range.
    """
    if not parts:
        raise ValueError("combine needs at least one (reward function, weight) pair")
    for fn, weight in parts:
        if not callable(fn) or isinstance(weight, bool) or not isinstance(weight, int | float):
            raise TypeError(f"combine takes (function, weight) pairs, got ({fn!r}, {weight!r})")
        if not finite_real(weight):
            raise ValueError(f"combine: the weight of {_name(fn)} is {weight!r}; give a finite "
                             "number")
    pickers = [(fn, float(w), _accepts(fn)) for fn, w in parts]

    def total(values: list[float | None]) -> float | None:
        for (fn, _, _), value in zip(pickers, values, strict=True):
            if value is not None and not (isinstance(value, bool) or finite_real(value)):
                raise ValueError(f"reward function {_name(fn)} returned {safe_repr(value)}; "
                                 "return a finite number, or None when it cannot judge")
        if all(v is None for v in values):
            return None
        summed = sum(w * v for (_, w, _), v in zip(pickers, values, strict=True) if v is not None)
        if not finite_real(summed):
            raise ValueError(f"the combined reward is {summed}: the weighted sum of "
                             f"{', '.join(_name(fn) for fn, _, _ in pickers)} overflows; "
                             "scale the weights down")
        return summed

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


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__
