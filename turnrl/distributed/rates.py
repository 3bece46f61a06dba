"""Rates the async learner measures while it runs: smoothed, online, pure (no Ray, no torch).

What sizes the rollout pool and the staleness bound (turnrl/distributed/sizing.py) is read
here from what actually happens, never from a table written for one machine:

- **generation**: rows a worker generates per second of generation, the mean rows per call
  and the mean call length, from the cumulative ``LoopStats`` counters each worker reports;
- **environment latency**: every env step's wall time (the worker's loop records them), a
  sliding window for the median and p90 and its mean (Little's law needs the mean); resets
  apart: an episode resets once and steps once a turn, so its env time per turn is the step
  mean plus the reset mean / turns (mixing them in one mean undercounts slow tools behind a
  fast reset: 0.65 s for 0.82 s steps at 4.7 turns);
- **learner**: the wall time of a step and the part of it the learner was busy (not waiting
  for groups), so the rate at which it *could* consume episodes is known even while it waits;
- **groups**: lifetime (first admission to delivery), turns per episode, staleness on arrival.

Smoothing is an exponentially weighted moving average (EWMA); its weight ``alpha`` is the
share of the newest sample. A window of recent samples gives quantiles.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class Ewma:
    """Exponentially weighted moving average; ``value`` is NaN until the first sample."""

    alpha: float = 0.3
    value: float = math.nan
    count: int = 0

    def update(self, sample: float) -> float:
        if math.isfinite(sample):
            self.value = sample if self.count == 0 else (
                self.alpha * sample + (1 - self.alpha) * self.value)
            self.count += 1
        return self.value


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (linear interpolation between order statistics); NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


@dataclass
class Window:
    """The last ``size`` samples: mean, median, p90."""

    size: int = 512
    samples: deque = field(default_factory=deque)
    total: int = 0
    """Samples ever added (the window keeps the last ``size``)."""

    def add(self, values: Iterable[float]) -> None:
        for value in values:
            if math.isfinite(value):
                self.samples.append(float(value))
                self.total += 1
        while len(self.samples) > self.size:
            self.samples.popleft()

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else math.nan

    def quantile(self, q: float) -> float:
        return quantile(self.samples, q)


@dataclass
class GenerationRate:
    """One worker's generation from its cumulative counters (``LoopStats.to_dict()``)."""

    alpha: float = 0.3
    rows_per_gen_s: Ewma = field(default_factory=Ewma)
    """Rows per second of generate-call time: what the worker can deliver when busy."""
    rows_per_call: Ewma = field(default_factory=Ewma)
    call_s: Ewma = field(default_factory=Ewma)
    busy: Ewma = field(default_factory=Ewma)
    """Fraction of wall time the worker was not waiting for episodes: 1 - idle / wall where
    it reports ``idle_s`` and ``clock_s`` (``TurnLoop.report``), else the generate calls'
    share (which reads 0.7-0.8 for a worker that never waits: its turn loop's own work is
    not in the calls, and an interval in which no call ended reads 0)."""
    live_per_group: Ewma = field(default_factory=Ewma)
    """Live episodes per group in play: below the group size while ended episodes wait for
    their group's slowest one (heavy-tailed tools make long waits)."""
    calls: deque = field(default_factory=lambda: deque(maxlen=256))
    """(rows, seconds) of recent generate calls for ``cost_model``: each call's own where the
    worker reports them (their sizes vary, so the fit is there), else each report
    interval's means."""
    last: dict | None = None
    last_at: float = math.nan

    def __post_init__(self) -> None:
        for ewma in (self.rows_per_gen_s, self.rows_per_call, self.call_s, self.busy,
                     self.live_per_group):
            ewma.alpha = self.alpha

    def observe(self, stats: Mapping[str, float], now: float,
                call_costs: Iterable[tuple[int, float]] = ()) -> None:
        """Counters as of ``now`` and the (rows, seconds) of each call since the last report;
        a counter that went backwards (a restarted worker) starts a new baseline."""
        call_costs = [(b, t) for b, t in call_costs if b > 0 and t > 0]
        self.calls.extend(call_costs)
        last, self.last, last_at, self.last_at = self.last, dict(stats), self.last_at, now
        if not last:
            return
        idle_measured = "idle_s" in stats and "clock_s" in stats and "clock_s" in last
        if idle_measured and stats["clock_s"] > last["clock_s"] \
                and stats["idle_s"] >= last.get("idle_s", math.inf):
            wall = stats["clock_s"] - last["clock_s"]
            self.busy.update(min(1.0, max(0.0, 1 - (stats["idle_s"] - last["idle_s"]) / wall)))
        calls = stats.get("generate_calls", 0) - last.get("generate_calls", 0)
        rows = stats.get("generated_rows", 0) - last.get("generated_rows", 0)
        seconds = stats.get("generate_s", 0.0) - last.get("generate_s", 0.0)
        if calls <= 0 or rows <= 0 or seconds <= 0:
            if calls == 0 and now > last_at and not idle_measured:
                self.busy.update(0.0)
            return
        if not call_costs:
            self.calls.append((rows / calls, seconds / calls))
        groups = stats.get("open_groups_at_calls", 0) - last.get("open_groups_at_calls", 0)
        if groups > 0:
            self.live_per_group.update(
                (stats.get("live_at_calls", 0) - last.get("live_at_calls", 0)) / groups)
        self.rows_per_gen_s.update(rows / seconds)
        self.rows_per_call.update(rows / calls)
        self.call_s.update(seconds / calls)
        if now > last_at and not idle_measured:
            self.busy.update(min(1.0, seconds / (now - last_at)))


    def cost_model(self) -> tuple[float, float] | None:
        """``(a, c)`` of ``call seconds = a + c x rows``, least squares over recent intervals:
        a is what a call costs whatever its size, 1/c the rows a second the worker reaches
        with large batches. None until the batch sizes seen vary enough to tell them apart."""
        if len(self.calls) < 8:
            return None
        rows = [b for b, _ in self.calls]
        secs = [t for _, t in self.calls]
        mean_b, mean_t = sum(rows) / len(rows), sum(secs) / len(secs)
        var_b = sum((b - mean_b) ** 2 for b in rows) / len(rows)
        if var_b < (0.1 * mean_b) ** 2:
            return None
        c = sum((b - mean_b) * (t - mean_t) for b, t in self.calls) / len(rows) / var_b
        if c <= 0 or mean_t - c * mean_b < 0:
            return None  # no per-call cost, or a negative one: noise, not a cost model
        return mean_t - c * mean_b, c


@dataclass
class MeasuredRates:
    """Everything the sizing controller reads, per worker and for the learner."""

    alpha: float = 0.3
    workers: dict[int, GenerationRate] = field(default_factory=dict)
    env_latency: Window = field(default_factory=Window)
    """Seconds of env steps."""
    reset_latency: Window = field(default_factory=lambda: Window(256))
    step_s: Ewma = field(default_factory=Ewma)
    """Learner wall time per step (collect + update + publish)."""
    busy_s: Ewma = field(default_factory=Ewma)
    """Learner time per step not spent waiting for groups."""
    lifetime: Window = field(default_factory=lambda: Window(256))
    """Seconds from a group's admission at a worker to its delivery."""
    arrival_staleness: Window = field(default_factory=lambda: Window(256))
    """Versions a group's oldest policy token was behind the learner when it arrived."""
    turns: Ewma = field(default_factory=Ewma)
    tokens: Ewma = field(default_factory=Ewma)
    """Tokens per episode (prompt and env text included): what a live episode's cache holds."""
    ess: Ewma = field(default_factory=Ewma)
    learner_steps: int = 0
    """Learner steps observed, the first (whose times are not kept) included."""

    def __post_init__(self) -> None:
        for ewma in (self.step_s, self.busy_s, self.turns, self.tokens, self.ess):
            ewma.alpha = self.alpha

    def observe_worker(self, worker: int, stats: Mapping[str, float], now: float,
                       env_latencies: Iterable[float] = (),
                       call_costs: Iterable[tuple[int, float]] = (),
                       reset_latencies: Iterable[float] = ()) -> None:
        self.workers.setdefault(worker, GenerationRate(self.alpha)).observe(stats, now,
                                                                            call_costs)
        self.env_latency.add(env_latencies)
        self.reset_latency.add(reset_latencies)

    def observe_groups(self, lifetimes: Iterable[float], staleness: Iterable[int],
                       turns: float, tokens: float) -> None:
        """Groups as they arrive (trained or not): lifetimes, staleness, per-episode means."""
        self.lifetime.add(lifetimes)
        self.arrival_staleness.add(staleness)
        self.turns.update(turns)
        self.tokens.update(tokens)

    def observe_step(self, step_s: float, waited_s: float, ess: float) -> None:
        """The first step's times are not kept: it waits for the pipeline to fill and pays
        one-off costs (allocator, lazy initialisation), so its busy time says little of the
        learner's speed (the tiny model at 1500 ms tools: 0.99 s against 0.58-0.66 later,
        and the pool sized on it went 768 -> 488 at the next decision)."""
        self.learner_steps += 1
        if self.learner_steps > 1:
            self.step_s.update(step_s)
            self.busy_s.update(max(step_s - waited_s, 1e-6))
        self.ess.update(ess)

    # ---- what the controller reads -----------------------------------------------------------

    def generation_rows_per_s(self) -> float:
        """Rows per second all workers together deliver while generating."""
        rates = [w.rows_per_gen_s.value for w in self.workers.values()
                 if math.isfinite(w.rows_per_gen_s.value)]
        return sum(rates) if rates else math.nan

    def capacity(self) -> tuple[float, float]:
        """(rows a second all workers reach with large batches, mean per-call cost a);
        NaN where a worker's cost model is not known yet."""
        models = [w.cost_model() for w in self.workers.values()]
        if not models or any(m is None for m in models):
            return math.nan, math.nan
        return sum(1 / c for _, c in models), sum(a for a, _ in models) / len(models)

    def env_s_per_turn(self) -> float:
        """Mean env seconds an episode spends per turn: a step, and its one reset spread
        over its turns (0 when nothing was measured)."""
        step = self.env_latency.mean if len(self.env_latency) else 0.0
        reset = self.reset_latency.mean if len(self.reset_latency) else 0.0
        turns = self.turns.value if math.isfinite(self.turns.value) else 1.0
        return step + reset / max(turns, 1.0)

    def least_busy(self) -> float:
        """How busy the least busy worker is (``GenerationRate.busy``; NaN until measured)."""
        values = [w.busy.value for w in self.workers.values() if math.isfinite(w.busy.value)]
        return min(values) if values else math.nan

    def live_per_group(self) -> float:
        """Live episodes per group in play, all workers (NaN until measured)."""
        values = [w.live_per_group.value for w in self.workers.values()
                  if math.isfinite(w.live_per_group.value)]
        return sum(values) / len(values) if values else math.nan

    def call_s(self) -> float:
        values = [w.call_s.value for w in self.workers.values() if math.isfinite(w.call_s.value)]
        return sum(values) / len(values) if values else math.nan

    def metrics(self) -> dict[str, float]:
        """The smoothed estimates, as ``rates/...`` metrics (NaN: not measured yet)."""
        workers = list(self.workers.values())

        def mean_of(name: str) -> float:
            values = [getattr(w, name).value for w in workers
                      if math.isfinite(getattr(w, name).value)]
            return sum(values) / len(values) if values else math.nan

        return {
            "rates/gen_rows_per_s": self.generation_rows_per_s(),
            "rates/gen_rows_per_call": mean_of("rows_per_call"),
            "rates/gen_call_s": self.call_s(),
            "rates/gen_busy": mean_of("busy"),
            "rates/live_per_group": self.live_per_group(),
            "rates/gen_capacity_rows_per_s": self.capacity()[0],
            "rates/env_latency_mean_s": self.env_latency.mean,
            "rates/env_latency_median_s": self.env_latency.quantile(0.5),
            "rates/env_latency_p90_s": self.env_latency.quantile(0.9),
            "rates/env_reset_mean_s": self.reset_latency.mean,
            "rates/env_s_per_turn": self.env_s_per_turn(),
            "rates/learner_steps_per_s": 1 / self.step_s.value if self.step_s.count else math.nan,
            "rates/learner_busy_s": self.busy_s.value,
            "rates/group_lifetime_s": self.lifetime.mean,
            "rates/group_lifetime_p90_s": self.lifetime.quantile(0.9),
            "rates/arrival_staleness_p90": self.arrival_staleness.quantile(0.9),
            "rates/turns_per_episode": self.turns.value,
            "rates/ess": self.ess.value,
        }
