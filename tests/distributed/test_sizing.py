"""Async sizing from measured rates: the estimators, the bounded-step hysteresis, and the
controller on simulated rate traces (a steady system, a sudden 16x latency change, an ESS
that collapses with staleness, noisy measurements)."""

from __future__ import annotations

import math
import random

import pytest

from turnrl.distributed.rates import Ewma, GenerationRate, MeasuredRates, Window, quantile
from turnrl.distributed.sizing import (
    BUSY_WORKER,
    SHORT_EFFICIENCY,
    BoundedStep,
    SizingController,
    kv_bytes_per_token,
    pool_memory_cap,
    short_of_episodes,
)

# ---- the estimators ---------------------------------------------------------------------------


def test_ewma_window_and_quantiles_against_hand_values():
    ewma = Ewma(alpha=0.5)
    assert math.isnan(ewma.value)
    assert ewma.update(4.0) == 4.0  # the first sample is the estimate
    assert ewma.update(2.0) == 3.0
    assert ewma.update(math.nan) == 3.0 and ewma.count == 2  # NaN is not a sample
    assert quantile([3, 1, 2, 4], 0.5) == 2.5 and quantile([5], 0.9) == 5
    assert math.isnan(quantile([], 0.5))
    window = Window(size=3)
    window.add([10, 1, 2, 3])  # the oldest falls out
    assert list(window.samples) == [1, 2, 3] and window.mean == 2 and window.quantile(0.9) == 2.8


def test_generation_rate_from_cumulative_counters_and_a_restart():
    rate = GenerationRate(alpha=1.0)
    rate.observe({"generate_calls": 10, "generated_rows": 100, "generate_s": 1.0}, now=0.0)
    assert math.isnan(rate.rows_per_gen_s.value)  # a baseline only
    rate.observe({"generate_calls": 20, "generated_rows": 300, "generate_s": 2.0}, now=2.0)
    assert rate.rows_per_gen_s.value == 200 and rate.rows_per_call.value == 20
    assert rate.call_s.value == pytest.approx(0.1) and rate.busy.value == pytest.approx(0.5)
    # A restarted worker's counters start again from 0: a new baseline, no negative rate.
    rate.observe({"generate_calls": 2, "generated_rows": 5, "generate_s": 0.1}, now=3.0)
    assert rate.rows_per_gen_s.value == 200
    rate.observe({"generate_calls": 4, "generated_rows": 45, "generate_s": 0.3}, now=4.0)
    assert rate.rows_per_gen_s.value == pytest.approx(200) and rate.busy.value == pytest.approx(0.2)


def test_busy_is_one_minus_idle_when_the_worker_reports_its_waits():
    """A worker whose calls outlast the report interval is busy, not idle: with its idle time
    and its own clock reported, an interval in which no call ended reads 1 - idle / wall."""
    rate = GenerationRate(alpha=1.0)
    counters = {"generate_calls": 4, "generated_rows": 40, "generate_s": 0.5}
    rate.observe({**counters, "idle_s": 1.0, "clock_s": 100.0}, now=0.0)
    rate.observe({**counters, "idle_s": 1.0, "clock_s": 100.5}, now=0.5)  # mid-call, no idle
    assert rate.busy.value == pytest.approx(1.0)
    rate.observe({"generate_calls": 5, "generated_rows": 50, "generate_s": 0.9,
                  "idle_s": 1.5, "clock_s": 102.5}, now=2.5)  # waited 0.5 s of 2 s
    assert rate.busy.value == pytest.approx(0.75)
    # The generate share alone would have read 0 and then 0.2 for the same worker.
    assert rate.rows_per_gen_s.value == pytest.approx(25)
    # A restarted worker (its counters and clock start again): no reading from the jump.
    rate.observe({"generate_calls": 1, "generated_rows": 8, "generate_s": 0.1,
                  "idle_s": 0.2, "clock_s": 3.0}, now=3.0)
    assert rate.busy.value == pytest.approx(0.75)


def test_measured_rates_metrics_name_every_estimate():
    rates = MeasuredRates()
    assert math.isnan(rates.metrics()["rates/env_latency_median_s"])
    rates.observe_worker(0, {"generate_calls": 0, "generated_rows": 0, "generate_s": 0}, 0.0,
                         [0.1, 0.2, 0.3, 0.4, 5.0])
    rates.observe_worker(0, {"generate_calls": 5, "generated_rows": 50, "generate_s": 0.5}, 1.0)
    rates.observe_step(step_s=21.0, waited_s=20.0, ess=1.0)  # the first: a warm-up, not kept
    assert math.isnan(rates.metrics()["rates/learner_busy_s"]) and rates.learner_steps == 1
    rates.observe_step(step_s=2.0, waited_s=0.5, ess=0.95)
    rates.observe_groups([1.0, 3.0], [2, 4], turns=5.0, tokens=120.0)
    m = rates.metrics()
    assert m["rates/env_latency_median_s"] == pytest.approx(0.3)
    assert m["rates/env_latency_mean_s"] == pytest.approx(1.2)  # the heavy tail is in the mean
    assert m["rates/env_latency_p90_s"] == pytest.approx(3.16)
    assert m["rates/gen_rows_per_s"] == 100 and m["rates/gen_busy"] == pytest.approx(0.5)
    assert m["rates/learner_steps_per_s"] == 0.5 and m["rates/learner_busy_s"] == 1.5
    assert m["rates/group_lifetime_s"] == 2.0 and m["rates/turns_per_episode"] == 5.0


# ---- bounded steps with hysteresis ------------------------------------------------------------


def test_bounded_step_holds_in_its_band_and_moves_at_most_a_factor():
    step = BoundedStep(value=10, low=1, high=300, band=0.25, max_factor=2.0, cooldown=0)
    assert step.propose(12) == 10  # inside the dead band
    assert step.propose(80) == 20  # at most x2 a change
    assert step.propose(80) == 40 and step.propose(80) == 80 and step.propose(80) == 80
    assert step.propose(1000) == 160 and step.propose(1000) == 300  # the cap (memory)
    assert step.propose(1) == 150 and step.changes == 6


def test_bounded_step_cannot_flip_forever():
    for decisions in (1000, 10000):
        step = BoundedStep(value=10, low=1, high=1000, band=0.25, max_factor=2.0, cooldown=1)
        moved_at, value = [], step.value
        for i in range(decisions):  # a target that flips between 5 and 20 every decision
            if step.propose(5 if i % 2 else 20) != value:
                moved_at.append(i)
                value = step.value
        # Each reversal doubles the wait and widens the band for the next one: O(log T)
        # changes, ever further apart.
        assert step.changes <= 2 * math.log2(decisions)
        assert moved_at[-1] - moved_at[-2] >= decisions / 8


def test_a_trend_after_noisy_reversals_is_followed_to_its_target():
    """Reversals widen the band only for the next reversal: a move that continues the last
    one's direction needs the base band, so a change of regime after some noise is followed
    all the way (the band widened for every move held a simulated pool 28% under Little's
    law after a 16x latency jump, the learner waiting)."""
    step = BoundedStep(value=100, low=1, high=100000, band=0.25, max_factor=2.0, cooldown=1)
    for i in range(40):  # noise: the target flips 100 <-> 160
        step.propose(160 if i % 2 else 100)
    reversals = step.reversals
    assert reversals >= 2
    for _ in range(100):  # then a regime 15x up (each move waits 2^reversals decisions)
        step.propose(1500)
    # 100 -> 200 (a reversal) -> 400 -> 800 -> 1500; the widened band (2x) stopped at 800.
    assert step.value == 1500 and step.reversals == reversals + 1


# ---- the controller on simulated traces -------------------------------------------------------

GROUP, GROUPS, TURNS = 8, 4, 5.0


class SimulatedSystem:
    """A worker whose generate call of ``b`` rows takes ``a + c b`` seconds, called whenever an
    episode waits (an episode back from its tool waits for the call in progress, then its
    own), episodes spending the env latency between turns, a learner busy ``busy_s`` a step:
    the steady state a pool of P episodes reaches, fed to the controller as it would measure
    it (the batch varies from report to report; ``noise`` jitters every measurement)."""

    def __init__(self, latency_s, a=0.01, c=0.0027, busy_s=0.5, ess_per_version=0.0,
                 noise=0.0, seed=0):
        self.latency_s, self.a, self.c, self.busy_s = latency_s, a, c, busy_s
        self.ess_per_version, self.noise = ess_per_version, noise
        self.random = random.Random(seed)
        self.counters = {"generate_calls": 0, "generated_rows": 0, "generate_s": 0.0}
        self.now = 0.0

    def steady(self, pool):
        """(rows/s, seconds a call, rows a call): P = r (E + 1.5 call), call = a + c b with
        b = r call the rows that arrive during one (at least 1), solved for r by bisection."""
        def call_at(r):
            return self.a / (1 - self.c * r) if r * self.a / (1 - self.c * r) >= 1 \
                else self.a + self.c
        low, high = 0.0, (1 - 1e-9) / self.c
        for _ in range(100):
            r = (low + high) / 2
            low, high = (r, high) if r * (self.latency_s + 1.5 * call_at(r)) < pool \
                else (low, r)
        call = call_at(low)
        return low, call, max(1.0, low * call)

    def _jitter(self, x):
        return x * (1 + self.noise * (2 * self.random.random() - 1))

    def step(self, rates, pool, bound):
        """Advance one learner step; feed ``rates``; (arrived, dropped) groups."""
        rows_per_s, call, batch = self.steady(pool)
        demand = GROUPS * GROUP * TURNS  # rows a step consumes
        step_s = max(self.busy_s, demand / rows_per_s)
        for _ in range(5):  # five worker reports a step, the batch varying between them
            b = batch * (0.7 + 0.6 * self.random.random())
            t = self.a + self.c * b
            calls = rows_per_s * step_s / 5 / b
            self.counters["generate_calls"] += calls
            self.counters["generated_rows"] += calls * b
            self.counters["generate_s"] += calls * self._jitter(t)
            self.now += step_s / 5
            rates.observe_worker(0, dict(self.counters), self.now,
                                 [self._jitter(self.latency_s) for _ in range(4)])
        lifetime = 1.5 * TURNS * (self.latency_s + 1.5 * call)  # a group's slowest episode
        staleness = lifetime / step_s
        arrived = GROUPS
        rates.observe_groups([self._jitter(lifetime) for _ in range(arrived)],
                             [round(self._jitter(staleness)) for _ in range(arrived)],
                             TURNS, 150.0)
        dropped = sum(round(self._jitter(staleness)) > bound for _ in range(arrived))
        ess = 1.0 - self.ess_per_version * min(bound, staleness)
        rates.observe_step(self._jitter(step_s), max(0.0, step_s - self.busy_s), ess)
        return arrived, dropped, rows_per_s


def _controller(pool=48, bound=2, max_pool=4096):
    return SizingController.start(group_size=GROUP, groups_per_step=GROUPS, workers=1,
                                  pool=pool, bound=bound, max_pool=max_pool)


def _run(system, controller, rates, steps, trace):
    for _ in range(steps):
        arrived, dropped, rows_per_s = system.step(rates, controller.pool.value,
                                                   controller.bound.value)
        controller.update(rates, arrived, dropped)
        trace.append((controller.pool.value, controller.bound.value, rows_per_s))
    return trace


def test_the_pool_grows_to_what_the_learner_consumes_and_the_bound_to_the_lifetime():
    system, controller, rates = SimulatedSystem(latency_s=0.8), _controller(), MeasuredRates()
    trace = _run(system, controller, rates, 60, [])
    pool, bound, rows_per_s = trace[-1]
    demand = GROUPS * GROUP * TURNS / system.busy_s  # 320 rows/s at full learner speed
    assert rows_per_s >= demand  # the learner no longer waits
    # Little's law: not far past what that rate needs (headroom 1.25, the dead band, a group).
    needed = demand * (system.latency_s + system.steady(pool)[1])
    assert needed <= pool <= 1.25 * 1.3 * needed + 2 * GROUP
    lifetime_versions = 1.5 * TURNS * (system.latency_s + system.steady(pool)[1]) / 0.5
    assert lifetime_versions <= bound <= 2 * lifetime_versions + 2
    assert controller.pool.changes + controller.bound.changes <= 14
    assert len({(p, b) for p, b, _ in trace[-20:]}) == 1  # settled: nothing moves


def test_a_sudden_latency_change_mid_run_converges_without_oscillating():
    system = SimulatedSystem(latency_s=0.05, noise=0.1, seed=1)
    controller, rates = _controller(), MeasuredRates()
    trace = _run(system, controller, rates, 80, [])
    fast_pool, fast_bound, _ = trace[-1]
    changes_before = controller.pool.changes + controller.bound.changes
    system.latency_s = 0.8  # tools 16x slower from here on
    _run(system, controller, rates, 120, trace)
    slow_pool, slow_bound, rows_per_s = trace[-1]
    assert slow_pool >= 4 * fast_pool and slow_bound > fast_bound
    assert rows_per_s >= 0.95 * GROUPS * GROUP * TURNS / system.busy_s  # throughput is back
    # It got there within 20 steps of the change, then stayed put (noise is in the band).
    settled = [(p, b) for p, b, _ in trace[100:]]
    assert len(set(settled[-60:])) <= 2
    total = controller.pool.changes + controller.bound.changes
    assert total - changes_before <= 12 and total <= 30
    # Back to fast tools: the pool shrinks again (bounded steps), memory is given back.
    system.latency_s = 0.05
    _run(system, controller, rates, 80, trace)
    assert trace[-1][0] <= slow_pool / 3


def test_a_collapsing_ess_caps_the_bound_below_what_throughput_asks():
    # ESS falls 0.04 per version of staleness: below the 0.6 floor past 10 versions, while the
    # lifetime asks for ~17. The bound must stop near 10 and stay there.
    system = SimulatedSystem(latency_s=0.8, ess_per_version=0.04, noise=0.05, seed=3)
    controller, rates = _controller(), MeasuredRates()
    trace = _run(system, controller, rates, 150, [])
    bounds = [b for _, b, _ in trace[-50:]]
    assert max(bounds) <= 11 and min(bounds) >= 5
    assert controller.ess_ceiling is not None or controller.patience > 3
    assert controller.bound.changes <= 20


def test_dropped_groups_raise_the_bound_while_ess_allows():
    controller, rates = _controller(bound=2), MeasuredRates()
    rates.observe_step(step_s=0.5, waited_s=0.0, ess=0.97)
    # Nothing about lifetimes yet: only the drops say the bound is too tight.
    decisions = [controller.update(rates, arrived=4, dropped=3) for _ in range(4)]
    assert math.isnan(decisions[0].bound_target)  # no lifetime, no arrival staleness yet
    rates.observe_groups([4.0] * 4, [6] * 4, TURNS, 100.0)
    decision = controller.update(rates, arrived=4, dropped=3)
    assert decision.bound > 2
    controller_low = _controller(bound=8)
    rates_low = MeasuredRates()
    rates_low.observe_groups([4.0] * 4, [6] * 4, TURNS, 100.0)
    for _ in range(3):
        rates_low.observe_step(step_s=0.5, waited_s=0.0, ess=0.3)  # too off-policy
        controller_low.update(rates_low, arrived=4, dropped=3)
    assert controller_low.bound.value < 8  # the ESS wins over the drops


def test_memory_cap_from_the_model_shape():
    class SmolLike:  # SmolLM2-135M: 30 layers, 3 key/value heads of 64
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 30, 9, 3, 576

    per_token = kv_bytes_per_token(SmolLike, element_size=4)
    assert per_token == 2 * 30 * 3 * 64 * 4
    cap = pool_memory_cap(per_token, tokens_per_episode=300, available_bytes=8 * 2**30,
                          fraction=0.25)
    assert cap == int(0.25 * 8 * 2**30 / (2 * per_token * 300))
    controller = _controller(pool=48, max_pool=cap)
    system, rates = SimulatedSystem(latency_s=3.0, c=0.02), MeasuredRates()
    _run(system, controller, rates, 60, [])
    assert controller.pool.value <= max(cap, GROUPS * GROUP)
    assert pool_memory_cap(0, math.nan, 0, 0.25) > 10**5  # unknown: no cap from memory


def test_a_worker_slower_than_the_learner_gets_a_finite_pool_not_the_memory_cap():
    # 1/c = 200 rows/s at any batch, the learner would take 320: more episodes cannot help.
    system = SimulatedSystem(latency_s=0.8, c=0.005, noise=0.05, seed=4)
    controller, rates = _controller(max_pool=100_000), MeasuredRates()
    trace = _run(system, controller, rates, 100, [])
    pool, _, rows_per_s = trace[-1]
    assert rows_per_s >= 0.85 * 200  # near what the worker can do
    assert pool <= 400 and len({p for p, _, _ in trace[-30:]}) == 1


def test_auto_sizing_is_the_default_and_its_memory_share_is_checked():
    from turnrl.config import ConfigError, load_config

    cfg = load_config(None, [])
    assert cfg.pool.auto and cfg.sampler.keep_kv_cache
    with pytest.raises(ConfigError, match="pool.memory_fraction"):
        load_config(None, ["--pool.memory_fraction", "0"])
    assert not load_config(None, ["--pool.auto", "false"]).pool.auto


def test_the_pool_never_asks_the_workers_for_more_than_most_of_their_capacity():
    def rates_with(busy_fraction):
        rates = MeasuredRates(alpha=1.0)
        rates.observe_step(step_s=0.5, waited_s=0.0, ess=1.0)  # demand: 32 x 5 / 0.5 s
        rates.observe_groups([4.0], [2], TURNS, 100.0)
        rates.env_latency.add([0.8])
        counters, now = {"generate_calls": 0, "generated_rows": 0, "generate_s": 0.0}, 0.0
        rates.observe_worker(0, dict(counters), now)
        for i in range(10):  # batches 10..28 at a = 0.01 s, c = 0.01 s: capacity 100 rows/s
            b = 10 + 2 * i
            counters["generate_calls"] += 1
            counters["generated_rows"] += b
            counters["generate_s"] += 0.01 + 0.01 * b
            now += (0.01 + 0.01 * b) / busy_fraction
            rates.observe_worker(0, dict(counters), now)
        return rates

    busy, idle = rates_with(0.95), rates_with(0.5)
    assert busy.capacity()[0] == pytest.approx(100)
    _, busy_rate = _controller().pool_target(busy)
    idle_pool, idle_rate = _controller().pool_target(idle)
    # The learner would take 1.25 x 32 x 5 / 0.5 = 400 rows/s; the worker reaches 100. Asking
    # for 400 sized pools for a rate no worker delivers (at 0 ms tools, 10x the pool needed).
    assert busy_rate == pytest.approx(90) and idle_rate == pytest.approx(90)  # 0.9 of capacity
    # The call it sizes by is the one predicted at that rate (a / (1 - c x 0.9 capacity) =
    # 0.1 s), not the long calls measured now: those would grow a too-big pool further.
    assert idle_pool == pytest.approx(idle_rate * (0.8 + 1.5 * 0.1) + GROUP, rel=1e-6)


# ---- what the first idle-machine runs showed (issue 19) -----------------------------------------


def test_the_first_move_replaces_the_start_guess_then_moves_are_bounded_again():
    step = BoundedStep(96, 32, 4096, jump_first=True)
    assert step.propose(344) == 344  # the start value was a guess: straight to the measurement
    step.wait = 0
    assert step.propose(2000) == 688  # from then on at most a factor 2 a change
    assert BoundedStep(96, 32, 4096).propose(344) == 192  # without it, the old ramp


def test_per_call_costs_give_a_cost_model_where_report_means_cannot():
    """Reports whose mean batch never changes say nothing about a call's fixed cost; the calls
    inside them vary (8 to 60 rows) and do."""
    a, c = 0.014, 0.0016
    calls = [(b, a + c * b) for b in (8, 20, 60, 12, 45, 30)]
    by_means, by_calls = GenerationRate(alpha=1.0), GenerationRate(alpha=1.0)
    counters = {"generate_calls": 0, "generated_rows": 0, "generate_s": 0.0}
    for report in range(12):
        counters = {"generate_calls": counters["generate_calls"] + len(calls),
                    "generated_rows": counters["generated_rows"] + sum(b for b, _ in calls),
                    "generate_s": counters["generate_s"] + sum(t for _, t in calls)}
        by_means.observe(dict(counters), now=float(report))
        by_calls.observe(dict(counters), now=float(report), call_costs=calls)
    assert by_means.cost_model() is None  # every interval has the same mean batch
    fitted_a, fitted_c = by_calls.cost_model()
    assert fitted_a == pytest.approx(a) and fitted_c == pytest.approx(c)


def test_groups_in_play_hold_fewer_live_episodes_than_their_size_and_more_are_issued():
    from turnrl.distributed.pool_sizing import open_groups

    rate = GenerationRate(alpha=1.0)
    rate.observe({"generate_calls": 0, "generated_rows": 0, "generate_s": 0.0,
                  "live_at_calls": 0, "open_groups_at_calls": 0}, now=0.0)
    # 10 calls, each with 40 groups in play holding 160 live episodes (4 of 8 each).
    rate.observe({"generate_calls": 10, "generated_rows": 100, "generate_s": 1.0,
                  "live_at_calls": 1600, "open_groups_at_calls": 400}, now=2.0)
    assert rate.live_per_group.value == 4.0
    assert open_groups(320, 8, rate.live_per_group.value) == 80  # not 320 / 8 = 40
    assert open_groups(320, 8, math.nan) == 40  # unknown: whole groups
    assert open_groups(320, 8, 0.2) == 320 and open_groups(320, 8, 9.0) == 40  # clamped


def _measured_worker(calls, seconds, latencies=8, alpha=1.0):
    """Rates of one worker that made ``calls`` ((rows, seconds) each) in ``seconds`` of wall
    time and measured ``latencies`` tool latencies of 0.8 s."""
    rates = MeasuredRates(alpha=alpha)
    rates.observe_worker(0, {"generate_calls": 0, "generated_rows": 0, "generate_s": 0.0}, 0.0)
    counters = {"generate_calls": len(calls), "generated_rows": sum(b for b, _ in calls),
                "generate_s": sum(t for _, t in calls)}
    rates.observe_worker(0, counters, seconds, [0.8] * latencies, calls)
    return rates


def test_before_the_first_step_the_pool_is_sized_for_what_the_workers_generate():
    """The first step waits a group's whole lifetime; sizing only after it made the next
    steps wait another lifetime for the groups the new pool started (idle-machine run: 1, 4,
    10 steps in the first three 10 s of 500 ms tools, then 16-21)."""
    calls = [(b, 0.01 + 0.01 * b) for b in (4, 9, 16, 25, 2, 12, 30, 7)]  # capacity 100 rows/s
    rates = _measured_worker(calls, 3.0)
    controller = _controller(pool=48)
    rates.env_latency.add([0.8] * 39)
    assert controller.presize(rates) is None  # 47 tool latencies: not one a live episode yet
    rates.env_latency.add([0.8])
    # The worker generated 1.4 s of the 3 s: idle, short of episodes. Little's law at 0.9 x
    # 100 rows/s asks 90 x (0.8 s tool + 1.5 x the 0.1 s call) + a group = 94; the learner's
    # speed is unknown yet, so at most x2 a move.
    assert controller.pool_target(rates)[0] == pytest.approx(90 * (0.8 + 1.5 * 0.1) + GROUP)
    assert controller.presize(rates) == 94
    # The next move waits until every live episode took about one turn at the new size.
    rates.env_latency.add([0.8] * 93)
    assert controller.presize(rates) is None
    small = _controller(pool=32)
    assert small.presize(rates) == 64  # x2 at most
    rates.env_latency.add([0.8] * 64)
    assert small.presize(rates) == 64  # the wait after a move holds it for one call
    assert small.presize(rates) == 94  # then on towards the target, still x2 at most
    busy = _measured_worker(calls, 1.15, latencies=64)  # generating 1.13 of 1.15 s
    assert not short_of_episodes(busy)
    assert _controller(pool=48).presize(busy) is None  # a busy worker is not short of episodes


def test_the_learner_s_first_step_is_a_warm_up_and_does_not_size_the_pool():
    """The first step waits for the pipeline to fill and pays one-off costs: its busy time
    read 0.99 s against 0.58-0.66 later (tiny model, 1500 ms tools), and the pool sized on it
    went 768 -> 488. Its times are not kept, and the pool holds until the second step."""
    calls = [(b, 0.01 + 0.01 * b) for b in (4, 9, 16, 25, 2, 12, 30, 7)]  # capacity 100 rows/s
    rates = _measured_worker(calls, 1.2, latencies=512)
    rates.observe_groups([9.0] * 4, [0] * 4, TURNS, 150.0)
    controller = _controller(pool=48)
    controller.pool.force(150)  # as the presize left it
    rates.observe_step(step_s=21.0, waited_s=20.0, ess=1.0)  # a 1 s first step, not kept
    assert math.isnan(rates.busy_s.value) and rates.learner_steps == 1
    assert controller.update(rates, arrived=4).pool == 150  # held: the learner is unmeasured
    rates.observe_step(step_s=0.3, waited_s=0.0, ess=1.0)
    target, _ = controller.pool_target(rates)  # 0.3 s a step: the workers' 90% binds
    assert target == pytest.approx(90 * (0.8 + 1.5 * 0.1) + GROUP)
    controller.pool.wait = 0
    assert controller.update(rates, arrived=4).pool == math.ceil(target)


def test_before_the_first_step_the_pool_only_grows_and_at_most_16x():
    """A cost fit of small, noisy calls can read a capacity many times too big, and nothing
    caps memory before the first step: the presize stops at 16x where it started. A target
    below the pool is left to the steps, which know the learner."""
    fixed = [(b, 0.04 + 0.0001 * b) for b in (2, 5, 3, 6, 4, 2, 7, 3)]  # capacity 10000
    rates = _measured_worker(fixed, sum(t for _, t in fixed) * 1.02, latencies=16)
    controller = _controller(pool=32)
    pools = []
    for _ in range(12):
        rates.env_latency.add([0.8] * 1024)  # every live episode took a turn
        pools.append(controller.presize(rates))
    assert max(p for p in pools if p) == 16 * 32
    assert pools[-1] is None  # stopped there
    idle = _measured_worker([(b, 0.01 + 0.01 * b) for b in (4, 9, 16, 25, 2, 12, 30, 7)],
                            3.0, latencies=400)
    big = _controller(pool=400)  # more than Little's law asks (94): not shrunk before a step
    assert big.presize(idle) is None and big.pool.value == 400


def test_a_busy_worker_whose_calls_are_mostly_fixed_cost_is_still_short_of_episodes():
    """The tiny model at 500 ms tools read 0.79-0.81 busy with 4 rows a call, 38-57 rows a
    second of calls against a capacity of 370-540: busy with calls that are mostly their
    fixed cost. More episodes make bigger calls at little more cost, so it grows before the
    first step, x2 a move, until its calls are efficient or the pool reaches Little's law."""
    fixed = [(b, 0.04 + 0.0025 * b) for b in (2, 5, 3, 6, 4, 2, 7, 3)]  # 400 rows/s at most
    rates = _measured_worker(fixed, sum(t for _, t in fixed) * 1.02, latencies=64)
    assert rates.least_busy() >= BUSY_WORKER
    assert rates.generation_rows_per_s() < SHORT_EFFICIENCY * rates.capacity()[0]
    assert short_of_episodes(rates)
    controller = _controller(pool=48)
    assert controller.presize(rates) == 96
    # SmolLM2-like: busy and its calls mostly per-row cost (1 s fixed, 0.15 s a row).
    per_row = [(b, 1.0 + 0.15 * b) for b in (30, 41, 36, 47, 33, 44, 39, 28)]
    big = _measured_worker(per_row, sum(t for _, t in per_row) * 1.02, latencies=64)
    assert not short_of_episodes(big)
    assert _controller(pool=48).presize(big) is None


def test_the_bound_covers_the_groups_a_grown_pool_has_in_flight_before_they_arrive():
    """Little's law in versions: groups issued and not yet trained are trained at
    ``groups_per_step`` a step, so the last of them is trained ``(in_system - 1) //
    groups_per_step`` steps after the next. A pool grown before the first step (48 -> 384 episodes, 48 groups) had
    its groups dropped by a bound sized from the few, young groups of the small pool that
    arrived first: 33 groups at step 5 (tiny model, 500 ms tools)."""
    rates = MeasuredRates(alpha=1.0)
    rates.observe_step(step_s=8.3, waited_s=7.5, ess=1.0)  # the first step waited
    rates.observe_groups([6.8] * 4, [0] * 4, TURNS, 150.0)  # young: 6.8 s / 8.3 s a step
    assert _controller(bound=2).bound_target(rates) < 2
    controller = _controller(bound=2)
    decision = controller.update(rates, arrived=4, dropped=0, in_system=52)
    assert decision.bound_target == 51 // GROUPS + 1  # the 52nd trains 12 steps after the next
    assert decision.bound == 13  # the first move goes to the measurement


def test_an_episode_s_one_reset_is_spread_over_its_turns_not_mixed_into_the_step_mean():
    """Little's law needs the env seconds an episode spends per turn. Mixing a fast reset
    into the step latencies' mean undercounts slow tools (0.65 s for 0.82 s steps at 4.7
    turns: the idle tiny run's pool came out ~20% small); timed apart, the reset is spread
    over the turns."""
    rates = MeasuredRates(alpha=1.0)
    assert rates.env_s_per_turn() == 0.0  # nothing measured: no tool time
    rates.observe_worker(0, {"generate_calls": 0, "generated_rows": 0, "generate_s": 0.0}, 0.0,
                         [0.8] * 8, reset_latencies=[0.0] * 2)
    assert rates.env_s_per_turn() == pytest.approx(0.8)  # turns unknown: one a reset
    rates.observe_groups([4.0], [3], turns=4.0, tokens=100.0)
    assert rates.env_s_per_turn() == pytest.approx(0.8)  # instant resets add nothing
    rates.reset_latency.add([2.0] * 2)  # a slow reset (a sandbox starting) counts, per turn
    assert rates.env_s_per_turn() == pytest.approx(0.8 + 1.0 / 4)
    m = rates.metrics()
    assert m["rates/env_latency_median_s"] == pytest.approx(0.8)  # the tool's, resets apart
    assert m["rates/env_s_per_turn"] == pytest.approx(1.05)
    # The controller sizes the pool by it.
    controller, fast = _controller(), MeasuredRates(alpha=1.0)
    for r in (rates, fast):
        for _ in range(2):  # the first step is a warm-up, not measured
            r.observe_step(step_s=1.0, waited_s=0.0, ess=1.0)
        r.observe_groups([4.0], [3], turns=4.0, tokens=100.0)
    fast.env_latency.add([0.8] * 8)
    slow_pool, rate = controller.pool_target(rates)
    fast_pool, _ = controller.pool_target(fast)
    assert slow_pool - fast_pool == pytest.approx(rate * 0.25)


def test_the_bound_covers_all_but_a_few_percent_of_arrivals_and_drops_are_judged_in_bulk():
    """A bound at a quantile q of the arrival staleness drops about 1 - q of the groups by
    construction (at the p90 the tiny model lost 9% of its groups at 500 ms tools). The
    bound aims at the p98; drops push it up only when they pass 5% of the groups that
    arrived since it last moved (one step's one drop in 4 arrivals is no evidence)."""
    rates = MeasuredRates(alpha=1.0)
    rates.observe_step(step_s=0.5, waited_s=0.0, ess=0.99)
    staleness = list(range(1, 101))  # 1..100 versions, uniform
    rates.observe_groups([1.0] * 100, staleness, TURNS, 100.0)
    controller = _controller(bound=2)
    target = controller.bound_target(rates)
    assert sum(s > target for s in staleness) <= 3  # a p90 bound would drop 10
    decision = controller.update(rates, arrived=4, dropped=0)
    assert decision.bound == math.ceil(target)  # the first move goes to the measurement
    # One drop among 4 arrivals, then nothing: no push (1 of 4 is not 5% of what arrived).
    steady = _controller(bound=8)
    rates_small = MeasuredRates(alpha=1.0)
    rates_small.observe_step(step_s=0.5, waited_s=0.0, ess=0.99)
    rates_small.observe_groups([1.0] * 64, [4] * 63 + [9], TURNS, 100.0)
    steady.update(rates_small, arrived=64, dropped=0)  # settles at the p98 + 1 = 5
    settled = steady.bound.value
    assert settled == 5
    for arrived, dropped in [(4, 1)] + [(4, 0)] * 30:
        assert steady.update(rates_small, arrived=arrived, dropped=dropped).bound == settled
    # Drops well past 5% of arrivals since the bound last moved push it up (x1.5).
    bounds = [steady.update(rates_small, arrived=4, dropped=2).bound for _ in range(6)]
    assert max(bounds) >= 1.5 * settled


def test_the_bound_never_drops_groups_already_delivered_unless_the_ess_caps_it():
    """SmolLM2 at 500 ms tools: the bound went 5 -> 4 with six groups 4 versions old in the
    buffer; they were dropped at the next step, which then waited 30 s for fresh ones. A
    delivered group cost its generation and was fresh on arrival: the bound keeps it, unless
    the importance weights say the data is too off-policy."""
    rates = MeasuredRates(alpha=1.0)
    rates.observe_step(step_s=50.0, waited_s=0.0, ess=0.9)
    rates.observe_groups([60.0] * 8, [2] * 8, TURNS, 150.0)  # the target: 60 / 50 + 1 -> 3
    controller = _controller(bound=5)
    controller.bound.changes = 1  # past the first move: bounded from here
    buffered = [4, 4, 4, 4, 5, 5]  # trained at this step and the next
    decision = controller.update(rates, arrived=4, dropped=0, buffered=buffered)
    assert decision.bound_target >= 5 and decision.bound == 5
    # Held by the dead band under what the buffer needs: raised to it anyway.
    tight = _controller(bound=4)
    tight.bound.changes = 1
    assert tight.update(rates, arrived=4, dropped=0, buffered=[5]).bound == 5
    # Nothing buffered: the bound shrinks towards the measured target as before.
    free = _controller(bound=8)
    free.bound.changes = 1
    assert free.update(rates, arrived=4, dropped=0).bound < 8
    # An ESS under the floor caps it even over the buffer.
    off = MeasuredRates(alpha=1.0)
    off.observe_step(step_s=50.0, waited_s=0.0, ess=0.3)
    off.observe_groups([60.0] * 8, [2] * 8, TURNS, 150.0)
    capped = _controller(bound=5)
    capped.bound.changes = 1
    assert capped.update(off, arrived=4, dropped=0, buffered=buffered).bound < 5
