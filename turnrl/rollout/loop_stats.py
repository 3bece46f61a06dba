"""The counters a turn loop keeps (a rollout worker reports them to the learner, whose
``rates.py`` turns them into rates)."""

from __future__ import annotations

import time
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

    def __post_init__(self) -> None:
        self._idle_since: float | None = None  # not a counter: a wait in progress

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def count_call(self, rows: int, seconds: float, live: int, open_groups: int,
                   overlapped: bool) -> None:
        """One generate call of ``rows`` rows, taking ``seconds``, with ``live`` episodes and
        ``open_groups`` groups in play, an env step running beside it or not."""
        self.generate_s += seconds
        self.generate_calls += 1
        self.generated_rows += rows
        self.live_at_calls += live
        self.open_groups_at_calls += open_groups
        self.overlapped_calls += overlapped

    async def idle(self, wait):
        """Await ``wait``, counting the time as idle (``idle_s``)."""
        self._idle_since = time.perf_counter()
        try:
            return await wait
        finally:
            since, self._idle_since = self._idle_since, None  # a reader never counts it twice
            self.idle_s += time.perf_counter() - since

    def report(self) -> dict[str, float]:
        """The counters now (any thread): ``idle_s`` includes a wait in progress, and
        ``clock_s`` is when they were read, on this process's clock, so that busy = 1 -
        idle / wall between two reports needs no other clock."""
        stats = self.to_dict()
        since = self._idle_since  # read second: a wait that just ended is never counted twice
        if since is not None:
            stats["idle_s"] += max(0.0, time.perf_counter() - since)
        stats["clock_s"] = time.perf_counter()
        return stats
