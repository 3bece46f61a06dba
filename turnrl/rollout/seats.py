"""The seats of a multi-seat game (self-play): what the turn loop needs beyond one episode.

Pure helpers, so the turn loop's seat bookkeeping (rollout/loop.py) stays short: reading a
finished game's per-seat results and checking them, e.g. that a zero-sum game's rewards sum
to zero (a broken game that pays both seats the same would otherwise train silently).
"""

from __future__ import annotations

import math
from typing import Any

from turnrl.rollout.env_calls import EnvError

ZERO_SUM_TOLERANCE = 1e-6


def seat_results(info: dict, seats: tuple[str, ...]) -> dict[str, dict]:
    """``info["seats"]`` of the step that ended a game, checked: every seat present with a
    finite number as its ``reward``. Returns seat -> a copy of its dict; ``EnvError`` (one line
    naming what is wrong) otherwise."""
    given = info.get("seats")
    if not isinstance(given, dict):
        raise EnvError("a step that ends a multi-seat game must give info['seats']: seat -> "
                       "{'reward': number, ...}")
    results = {}
    for seat in seats:
        entry = given.get(seat)
        reward = entry.get("reward") if isinstance(entry, dict) else None
        if (isinstance(reward, bool) or not isinstance(reward, (int, float))
                or not math.isfinite(reward)):
            raise EnvError(f"info['seats'][{seat!r}] must be a dict with a finite 'reward', "
                           f"got {_preview(entry)}")
        results[seat] = dict(entry)
    return results


def zero_sum_violation(rewards: dict[str, float]) -> str | None:
    """Why the seats' rewards of one zero-sum game are wrong (they do not sum to zero; the
    worst case, every seat paid the same nonzero reward, is named as such), else None."""
    total = sum(rewards.values())
    if abs(total) <= ZERO_SUM_TOLERANCE:
        return None
    values = set(rewards.values())
    same = len(values) == 1 and next(iter(values)) != 0
    what = "every seat got the same reward" if same else "the rewards do not sum to zero"
    shown = ", ".join(f"{seat} {reward:g}" for seat, reward in rewards.items())
    return f"zero-sum game, but {what} ({shown}; sum {total:g})"


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
