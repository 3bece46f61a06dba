"""Async mode sizes itself: the rollout pool and the staleness bound from measured rates.

Pure (no Ray, no torch): ``SizingController.update`` reads ``MeasuredRates``
(turnrl/distributed/rates.py) once per learner step and returns the pool, the queue and the
bound to use next. ``RaySource`` applies them (``pool.auto``, on by default).

**Pool: Little's law** (Little 1961, "A proof for the queuing formula L = lambda W",
Operations Research 9(3)). Episodes in flight = the rate at which they must take turns x the
time one turn takes. The rate is what the learner consumes at full speed, with headroom:
``lambda = headroom x episodes per step x turns per episode / learner busy seconds per step``
(its busy time, not its wall time: a learner that waits says nothing about how fast it could
go), and no more than the workers can generate when they are already busy. A turn takes the
environment's mean latency plus a generate call. So ``pool = lambda x (env latency + call) +
one group per worker`` (a group is only started whole). The same law sizes the queue of
groups waiting at each worker: groups finish at ``lambda / (turns x group size)`` a second
and the learner tops the workers up only between its updates, so a queue of that rate x the
learner's busy time keeps a pool full while the learner trains.

**Staleness bound: the throughput it needs, capped by what the correction can absorb.**
A group lives L seconds from its first token to delivery while the learner steps S times a
second, so it arrives about L x S versions old (docs/benchmarks.md, async);
a bound below that drops the groups the pool was sized to deliver. Of the groups issued
and not yet trained the last is trained ``(in_system - 1) // groups_per_step`` steps after
the next (Little's law in versions: it sees a pool that grew before its groups arrived; an
upper estimate, as unstarted queued groups count). The target is the
largest of ``p98(L) x S``, that, and the p98 of the staleness groups actually arrived with,
plus one (a bound at a quantile q drops about 1 - q of the groups by construction: at the
p90 the tiny model lost 9% of its groups at 500 ms); groups dropped beyond
``drop_fraction`` of those that arrived since the bound last moved push it up. The
importance weights' effective sample size (ESS) caps it:
when the smoothed ESS falls below ``ess_floor`` the bound shrinks and a ceiling is set there,
lifted only after the ESS has stayed above ``ess_high`` for a patience that doubles each time
(so grow/shrink cycles die out).

**It cannot oscillate forever.** Each quantity moves through a ``BoundedStep``: it holds
while the target is within a relative dead band of the current value, moves at most a factor
``max_factor`` per change, and waits ``cooldown`` decisions after a change (so the rates
reflect the new size). Every reversal of direction widens the band for the next reversal by
half (up to 2x) and doubles the wait: a target that keeps flipping makes changes ever further
apart (k reversals, a wait of 2^k decisions, so O(log T) reversals in T steps), while a real
change of regime (tool latency 10x up) still moves it, and all the way: a move that continues
the last one's direction needs only the base band (between two reversals such moves are
bounded by the target's range, as each goes to the target or 2x). Only the first move is not
bounded: it replaces the start value, a guess made before anything was measured, with the
first measurement. The band and factors are fractions, not rates tuned to a machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from turnrl.distributed.rates import MeasuredRates

BUSY_WORKER = 0.8
"""A worker busy (not waiting for episodes) this share of the time or more is near capacity:
while its cost model is unknown, the pool's rate is capped at x1.5 what it generates."""
CAPACITY_SHARE = 0.9
"""The pool is sized for at most this share of the rows a second the workers reach with
large batches: the batch a rate ``x`` of capacity needs grows like ``x / (1 - x)``."""


PRESIZE_GROWTH = 16
"""Before the first step the pool grows to at most this many times where it started: four
doublings (the tiny model at 500 ms tools needed three, 48 -> 384)."""
SHORT_EFFICIENCY = 1 / 3
"""A worker whose calls deliver under this share of the rows a second its cost model reaches
with large batches spends most of each call on fixed costs: it is short of episodes however
busy it looks (doubling such a batch raises its rows a second by 1.5x or more)."""


def short_of_episodes(rates: MeasuredRates) -> bool:
    """More live episodes would raise what the workers generate: the least busy idles
    (``BUSY_WORKER``), or their calls together are mostly fixed cost (``SHORT_EFFICIENCY``,
    all workers' rows a second of calls against their summed capacity). The tiny model at 500 ms
    tools read 0.79-0.81 busy while generating 38-57 rows a second of calls against a
    capacity of 370-540 (4 rows a call); SmolLM2 reads 0.97-1.0 busy at 0.56 of its
    (early, overestimated) capacity."""
    if rates.least_busy() < BUSY_WORKER:  # False while unmeasured (NaN)
        return True
    capacity, _ = rates.capacity()
    generated = rates.generation_rows_per_s()
    return math.isfinite(capacity) and generated < SHORT_EFFICIENCY * capacity


BOUND_QUANTILE = 0.98
"""The staleness bound covers this share of arrivals (the rest are dropped as too stale)."""


MAX_BAND = 1.0
"""The dead band never grows past this: a target twice the value (or half) always moves it."""


@dataclass
class BoundedStep:
    """An integer moved towards a target in bounded steps with hysteresis (module docstring)."""

    value: int
    low: int
    high: int
    band: float = 0.25
    max_factor: float = 2.0
    cooldown: int = 1
    changes: int = 0
    reversals: int = 0
    direction: int = 0
    wait: int = 0
    jump_first: bool = False
    """The first move goes straight to the target: the start value is a guess made before
    anything was measured, the first target is the first measurement (one change more)."""

    def propose(self, target: float) -> int:
        if not math.isfinite(target):
            return self.value
        target = min(max(math.ceil(target), self.low), self.high)
        if self.wait > 0:
            self.wait -= 1
            return self.value
        direction = 1 if target > self.value else -1
        # Only a move against the last one needs the band the reversals widened: one that
        # continues it follows a trend, which the wide band would leave up to 2x short (a
        # simulated 16x latency jump held the pool 28% under Little's law, the learner waiting).
        reverses = bool(self.direction) and direction != self.direction
        band = min(MAX_BAND, self.band * 1.5 ** self.reversals) if reverses else self.band
        if self.value / (1 + band) <= target <= self.value * (1 + band) + 0.5:
            return self.value
        if self.jump_first and not self.changes:
            new = target
        elif direction > 0:
            new = min(target, math.ceil(self.value * self.max_factor), self.high)
            new = max(new, self.value + 1)
        else:
            new = max(target, math.floor(self.value / self.max_factor), self.low)
            new = min(new, self.value - 1)
        self.reversals += reverses
        self.direction, self.value = direction, new
        self.changes += 1
        self.wait = self.cooldown * 2 ** self.reversals
        return new

    def force(self, value: int) -> None:
        """Set outright (the ESS cap), counted as a change."""
        value = min(max(value, self.low), self.high)
        if value != self.value:
            self.value, self.changes = value, self.changes + 1
            self.wait = max(self.wait, self.cooldown)  # never shortens a reversal's wait


@dataclass(frozen=True)
class SizingDecision:
    pool: int
    """Live episodes, all workers together."""
    queued_groups: int
    """Groups waiting at each worker beyond its pool."""
    bound: int
    """Staleness bound (``max_versions``) for the next step's groups."""
    pool_target: float
    bound_target: float
    ess_ceiling: int | None

    def metrics(self) -> dict[str, float]:
        return {"sizing/pool": float(self.pool), "sizing/queued_groups": float(self.queued_groups),
                "sizing/max_versions": float(self.bound), "sizing/pool_target": self.pool_target,
                "sizing/bound_target": self.bound_target,
                "sizing/ess_ceiling": math.nan if self.ess_ceiling is None
                else float(self.ess_ceiling)}


@dataclass
class SizingController:
    """Pool, queue and staleness bound from measured rates (see the module docstring)."""

    group_size: int
    groups_per_step: int
    workers: int
    pool: BoundedStep
    bound: BoundedStep
    headroom: float = 1.25
    ess_floor: float = 0.6
    ess_high: float = 0.9
    drop_fraction: float = 0.05
    """Groups dropped as too stale beyond this share of arrivals push the bound up."""
    since_bound_moved: list[int] = field(default_factory=lambda: [0, 0])
    """(arrived, dropped) since the bound last changed: drops under an older bound say
    nothing about this one, and one step's few arrivals are too few to judge by."""
    patience: int = 3
    queued: int = 0
    presized_at: int = 0
    """Env steps measured when the pool was last presized."""
    presize_start: int | None = None
    ess_ceiling: int | None = None
    high_streak: int = 0
    history: list[SizingDecision] = field(default_factory=list, repr=False)

    @classmethod
    def start(cls, *, group_size: int, groups_per_step: int, workers: int, pool: int,
              bound: int, max_pool: int, max_bound: int = 256, ess_floor: float = 0.6,
              ess_high: float = 0.9) -> SizingController:
        """Start at ``pool`` episodes and ``bound`` versions (the config's values)."""
        min_pool = groups_per_step * group_size  # a step's worth of groups in play
        max_pool = max(max_pool, min_pool)
        return cls(group_size, groups_per_step, workers,
                   BoundedStep(min(max(pool, min_pool), max_pool), min_pool, max_pool,
                               jump_first=True),
                   BoundedStep(min(max(bound, 1), max_bound), 1, max_bound, band=0.2,
                               jump_first=True),
                   ess_floor=ess_floor, ess_high=ess_high)

    def pool_target(self, rates: MeasuredRates) -> tuple[float, float]:
        """(episodes in flight, turns a second they must take) by Little's law. Before the
        learner has been measured the rate is what the workers can generate (``presize``);
        NaN while that is not known either."""
        turns, busy_s = rates.turns.value, rates.busy_s.value
        if math.isfinite(turns) and math.isfinite(busy_s) and busy_s > 0:
            rate = self.headroom * self.groups_per_step * self.group_size * turns / busy_s
        else:
            rate = math.inf  # no step yet: as fast as the workers go, capped below
        capacity, per_call = rates.capacity()
        call_s = rates.call_s() if math.isfinite(rates.call_s()) else 0.0
        generated = rates.generation_rows_per_s()
        # Only a busy worker is near its capacity; one that idles can take more episodes.
        at_capacity = rates.least_busy() >= BUSY_WORKER and math.isfinite(generated)
        if math.isfinite(capacity):
            # What it generates is a lower bound of what it can (a fit blurred by noise says
            # less). Never ask the workers for more than most of it, busy or not: the batch
            # (and the pool) a rate near capacity needs grows without bound, and a rate past
            # it (a fast learner's demand) sized pools 10x what a 0 ms tool needs.
            capacity = max(capacity, generated if math.isfinite(generated) else 0.0)
            rate = min(rate, CAPACITY_SHARE * capacity)
            # The call at that rate's batch b = rate x call: call = a + c b = a / (1 - c rate).
            # Predicted, not the call measured now: a pool too big makes long calls, and
            # sizing by them would grow it further.
            call_s = per_call / (1 - min(rate, CAPACITY_SHARE * capacity) / capacity)
        elif at_capacity:
            rate = min(rate, 1.5 * generated)  # cost unknown: grow by steps only
        if not math.isfinite(rate):
            return math.nan, math.nan
        # A returning episode waits for the call in progress (half a call on average), then
        # its own; then the tool.
        return (rate * (rates.env_s_per_turn() + 1.5 * call_s) + self.group_size * self.workers,
                rate)

    def presize(self, rates: MeasuredRates, min_latencies: int = 16) -> int | None:
        """The pool before the first learner step, grown (x2 a move, at most
        ``PRESIZE_GROWTH`` x the start) towards the rate the workers can generate while they
        are short of episodes (``short_of_episodes``).

        The first step waits for a whole group's lifetime (seconds with slow tools); sizing
        only after it would make every later step wait a lifetime more for the groups the
        new pool starts. A move is judged only after every live episode has taken about one
        turn since the last (so the rates describe the pool as it is); the steps after the
        first correct it. Returns the pool (unchanged while the dead band or the wait after
        a move holds it); None when nothing is to be done: not enough measured yet, the
        workers not short, or no larger target."""
        measured = rates.env_latency.total
        if measured - self.presized_at < max(min_latencies, self.pool.value) \
                or not short_of_episodes(rates):
            return None
        if self.presize_start is None:
            self.presize_start = self.pool.value
        target, _ = self.pool_target(rates)
        # At most x2 a move: the learner's speed is unknown yet, and a slow learner needs far
        # less than the workers' capacity (SmolLM2: a pool of 195 made 100 s group
        # lifetimes). The total is bounded too: a cost fit of small, noisy calls can read a
        # capacity (and so a target) many times too big, and no memory was measured yet.
        target = min(target, 2 * self.pool.value, PRESIZE_GROWTH * self.presize_start)
        before = self.pool.value
        if not math.isfinite(target) or target <= before:
            return None  # only grows: shrinking is for the steps, which know the learner
        pool = self.pool.propose(target)
        if pool != before:
            self.presized_at = measured
        return pool

    def bound_target(self, rates: MeasuredRates, in_system: int = 0) -> float:
        """The staleness groups will arrive with, plus one: the largest of the p98 of
        lifetime x step rate, the p98 of what arrived, and the steps until the last of the
        ``in_system`` groups (issued, not yet trained) is trained at ``groups_per_step`` a
        step (Little's law in versions). The last sees a pool that grew before its groups
        arrived: the first two only measure the groups of the smaller pool before it."""
        steps_per_s = 1 / rates.step_s.value if rates.step_s.count else math.nan
        lifetime = rates.lifetime.quantile(BOUND_QUANTILE)
        needed = lifetime * steps_per_s if len(rates.lifetime) else math.nan
        seen = rates.arrival_staleness.quantile(BOUND_QUANTILE)
        # The last of them is trained (in_system - 1) // groups_per_step steps after the next.
        queued = (in_system - 1) // self.groups_per_step if in_system else math.nan
        candidates = [x for x in (needed, seen, queued) if math.isfinite(x)]
        return max(candidates) + 1 if candidates else math.nan

    def update(self, rates: MeasuredRates, arrived: int = 0, dropped: int = 0,
               max_pool: int | None = None, in_system: int = 0,
               buffered: Sequence[int] = ()) -> SizingDecision:
        """One decision per learner step: ``arrived`` groups since the last, ``dropped`` of
        them as too stale; ``max_pool`` a new memory cap (episodes) when it was re-measured;
        ``in_system`` the groups issued and not yet trained (``bound_target``); ``buffered``
        the staleness each group already delivered will have at the step it is trained.

        The bound never falls below ``buffered`` (unless the ESS caps it): those groups
        were generated and judged fresh, and a bound moved under them throws that work away
        and starves the learner (SmolLM2 at 500 ms: the bound went 5 -> 4 with 6 groups of
        4 versions waiting, which were dropped, and the next step waited 30 s)."""
        if max_pool is not None:
            self.pool.high = max(max_pool, self.pool.low)
        pool_target, rate = self.pool_target(rates)
        if rates.busy_s.count:  # held until the learner's speed is measured (from step 2)
            self.pool.propose(pool_target)
        elif self.pool.value > self.pool.high:
            self.pool.force(self.pool.high)  # a memory cap binds all the same
        if math.isfinite(rate) and math.isfinite(rates.busy_s.value):
            groups_per_s = rate / max(rates.turns.value, 1.0) / self.group_size
            per_worker = groups_per_s * rates.busy_s.value / self.workers
            self.queued = min(math.ceil(per_worker) + 1, self.pool.value // self.group_size)
        bound_target = self.bound_target(rates, in_system)
        self.since_bound_moved[0] += arrived
        self.since_bound_moved[1] += dropped
        seen, lost = self.since_bound_moved
        # Judged over at least 1 / drop_fraction arrivals: one drop alone is no evidence.
        if (seen * self.drop_fraction >= 1 and lost > self.drop_fraction * seen
                and math.isfinite(bound_target)):
            bound_target = max(bound_target, self.bound.value * 1.5)  # drops say: too tight
        held = max(buffered, default=0)
        bound_target = max(bound_target, held) if math.isfinite(bound_target) \
            else (held or math.nan)
        bound_before = self.bound.value
        self._ess_cap(rates.ess.value)
        if self.ess_ceiling is not None:
            bound_target = min(bound_target, self.ess_ceiling)
            held = min(held, self.ess_ceiling)
        self.bound.propose(bound_target)
        if self.bound.value < held:  # the dead band held it under what is already here
            self.bound.force(held)
        if self.ess_ceiling is not None and self.bound.value > self.ess_ceiling:
            self.bound.force(self.ess_ceiling)
        if self.bound.value != bound_before:
            self.since_bound_moved = [0, 0]
        decision = SizingDecision(self.pool.value, self.queued, self.bound.value, pool_target,
                                  bound_target, self.ess_ceiling)
        self.history.append(decision)
        return decision

    def _ess_cap(self, ess: float) -> None:
        """Shrink and cap the bound while the smoothed ESS is below the floor; lift the cap
        after ``patience`` steps above ``ess_high`` (the patience doubles each time)."""
        if not math.isfinite(ess):
            return
        if ess < self.ess_floor:
            self.high_streak = 0
            if self.ess_ceiling is None or self.ess_ceiling >= self.bound.value:
                shrunk = max(self.bound.low, math.floor(self.bound.value * 0.75))
                shrunk = min(shrunk, max(self.bound.low, self.bound.value - 1))
                self.ess_ceiling = shrunk
                self.bound.force(shrunk)
        elif ess > self.ess_high and self.ess_ceiling is not None:
            self.high_streak += 1
            if self.high_streak >= self.patience:
                self.ess_ceiling = None
                self.high_streak = 0
                self.patience *= 2
        else:
            self.high_streak = 0


def pool_memory_cap(kv_bytes_per_token: float, tokens_per_episode: float,
                    available_bytes: float, fraction: float) -> int:
    """Live episodes whose keys/values fit in ``fraction`` of ``available_bytes`` (x2 for
    the activations of the call that extends them); a large number when nothing is known."""
    per_episode = 2 * kv_bytes_per_token * tokens_per_episode
    if not (per_episode > 0 and math.isfinite(per_episode)) or available_bytes <= 0:
        return 1 << 20
    return max(1, int(fraction * available_bytes / per_episode))


def kv_bytes_per_token(model_config, element_size: int) -> int:
    """Bytes of keys and values one token keeps in every layer of a decoder."""
    layers = getattr(model_config, "num_hidden_layers", 0)
    heads = getattr(model_config, "num_attention_heads", 1)
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or (
        getattr(model_config, "hidden_size", 0) // max(heads, 1))
    return 2 * layers * kv_heads * head_dim * element_size
