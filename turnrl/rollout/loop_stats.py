"""The counters a turn loop keeps (a rollout worker reports them to the learner, whose
``rates.py`` turns them into rates)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class LoopStats:
    """Counters of one loop (a worker reports them to the learner)."""

    generate_calls: int = 0
    generated_rows: int = 0
    overlapped_calls: int = 0
    """Generate calls made while at least one environment step was still running."""
    episodes_started: int = 0
    episodes_finished: int = 0
    groups_finished: int = 0
    max_live: int = 0
    live_at_calls: int = 0
    """Sum over generate calls of the live episodes at the call (/ calls: the mean pool)."""
    open_groups_at_calls: int = 0
    """Sum over generate calls of the groups in play (live episodes per open group)."""
    version_swaps: int = 0
    generate_s: float = 0.0
    idle_s: float = 0.0
    """Seconds the loop waited with no episode waiting for the policy (for env steps,
    resets or new groups): a worker short of episodes, where 1 - idle / wall is how busy it
    is (generate calls alone miss the loop's own work, a quarter of a tiny-model worker)."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)
