"""Asynchronous training: the continuous turn loop, the learner's books, and Ray end to end."""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from functools import partial
from types import SimpleNamespace

import pytest

from tests.conftest import groups_within
from turnrl.config import load_config
from turnrl.distributed.book import AssignmentBook, GroupPlan, in_flight_groups
from turnrl.distributed.source import RaySource
from turnrl.envs import StepResult, make_env
from turnrl.policy import group_seed, training_seeds
from turnrl.rollout import ChatFormat, run_sync
from turnrl.rollout.loop import Group, TurnLoop
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.trainer.buffer import group_staleness, split_stale
from turnrl.types import ENV_VERSION, Episode

# ---- (a) the continuous loop, plain asyncio, tiny model ---------------------------------------


class LatencyEnv:
    """``turns`` turns; each step sleeps a random few ms; ``slow_seed``'s first step ``slow`` s.

    ``stuck_seed`` never answers; ``error_seed`` raises. Step spans go to ``log``.
    """

    def __init__(self, log, turns=3, slow_seed=None, slow=0.0, stuck_seed=None, error_seed=None):
        self.log, self.turns, self.slow_seed, self.slow = log, turns, slow_seed, slow
        self.stuck_seed, self.error_seed = stuck_seed, error_seed
        self.rng = random.Random(0)

    async def reset(self, seed):
        self.seed, self.turn = seed, 0
        return "Say a digit."

    async def step(self, action):
        self.turn += 1
        start = time.time()
        if self.seed == self.stuck_seed:
            await asyncio.Event().wait()
        if self.seed == self.error_seed:
            raise ValueError("boom")
        slow = self.seed == self.slow_seed and self.turn == 1
        await asyncio.sleep(self.slow if slow else self.rng.uniform(0, 0.02))
        self.log.append((self.seed, start, time.time()))
        done = self.turn >= self.turns
        return StepResult("Again." if not done else "", 1.0, done, {"success": done})


class RecordingEngine:
    """The HF engine, recording when each generate call happens and how big it is."""

    def __init__(self, engine):
        self.inner, self.calls = engine, []

    @property
    def version(self):
        return self.inner.version

    def load(self, weights, version):
        self.inner.load(weights, version)

    def generate(self, prompts, params):
        self.calls.append((time.time(), len(prompts)))
        return self.inner.generate(prompts, params)


def _loop(tiny, make, *, group_size=2, **kwargs):
    model, tok = tiny
    chat = ChatFormat(tok)
    engine = RecordingEngine(HFEngine(model, tok.pad_token_id, seed=0))
    params = SamplingParams(3, 1.0, stop_token_ids=(chat.end_of_turn,))
    return TurnLoop(make, engine, chat, params, group_size=group_size,
                             env_name="latency", **kwargs), engine


def test_a_slow_env_step_does_not_hold_back_the_other_episodes(tiny):
    log = []
    rollout, engine = _loop(tiny, partial(LatencyEnv, log, slow_seed=100, slow=4.0))
    for assignment, seed in enumerate([100, 101, 102, 103]):
        rollout.submit(assignment, seed)
    run_sync(rollout.run(until_drained=True))
    groups = rollout.take_groups()

    assert sorted(g.assignment for g in groups) == [0, 1, 2, 3]
    assert all(len(g.episodes) == 2 and g.seed == 100 + g.assignment for g in groups)
    assert all(ep.status == "done" and len(ep.turns) == 3 for g in groups for ep in g.episodes)
    assert groups[-1].assignment == 0  # the slow group is delivered last, the others first
    # While the slow group's first step was pending, the others played their two remaining
    # turns (two more generate calls) and finished.
    slow_start = min(start for seed, start, _ in log if seed == 100)
    slow_end = max(end for seed, start, end in log if seed == 100 and start == slow_start)
    during = [t for t, _ in engine.calls if slow_start < t < slow_end]
    assert len(during) >= 2, "the others kept generating while a slow step was pending"
    assert all(g.finished_at < slow_end for g in groups if g.assignment != 0)
    assert rollout.stats.overlapped_calls >= 2
    assert max(size for _, size in engine.calls) > 2  # episodes of several groups batched
    assert rollout.known_assignments() == set()


def test_a_re_sent_assignment_is_played_once_whether_queued_or_in_play(tiny):
    """Submitting an assignment the loop holds, queued or started, is a no-op, and a queued
    one is known as such; once its group has been delivered and taken, it may come again."""
    rollout, _ = _loop(tiny, lambda: make_env("slow", env="say-digit", median_ms=0,
                                              options={"turns": 1}), pool_size=2)
    for assignment in (0, 1, 0, 2, 1):
        rollout.submit(assignment, 10 + assignment)
    assert rollout.known_assignments() == {0, 1, 2}
    run_sync(rollout.run(until_drained=True))
    assert sorted(g.assignment for g in rollout.take_groups()) == [0, 1, 2]
    rollout.submit(0, 10)  # taken away: a new delivery of it is played again
    assert rollout.known_assignments() == {0}


def test_a_withdrawn_assignment_leaves_the_queue_and_is_not_played(tiny):
    rollout, _ = _loop(tiny, lambda: make_env("slow", env="say-digit", median_ms=0,
                                              options={"turns": 1}), pool_size=2)
    for assignment in (0, 1, 2, 3):
        rollout.submit(assignment, 10 + assignment)
    assert rollout.withdraw([1, 3, 7]) == [1, 3]  # 7 was never here
    assert rollout.known_assignments() == {0, 2}
    run_sync(rollout.run(until_drained=True))
    assert sorted(g.assignment for g in rollout.take_groups()) == [0, 2]
    assert rollout.withdraw([0]) == []  # played and taken: nothing queued to drop


def test_the_loop_reports_its_waits_for_env_steps_as_idle_time(tiny):
    """A loop whose episodes all wait on a slow env counts the waits as idle (a wait still in
    progress included): the measure of a busy worker (rates.py), where generate calls alone
    read a worker that never waits as 70-80% busy."""
    rollout, _ = _loop(tiny, lambda: make_env("slow", env="say-digit", median_ms=300,
                                              sigma=0.0, options={"turns": 3}))
    rollout.submit(0, 0)
    readings = []

    def read_mid_wait():
        """Once a wait has lasted 0.1 s, read the counters while it still goes on (timed by
        the wait itself, not by the clock: on a busy machine the first generate call alone
        can outlast any fixed delay)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            since, ended = rollout.stats._idle_since, rollout.stats.idle_s  # waits ended so far
            if since is not None and time.perf_counter() - since >= 0.1:
                reading = rollout.stats.report()
                if rollout.stats._idle_since == since:  # that same wait, still in progress
                    readings.append((ended, reading))
                    return
            time.sleep(0.005)

    reader = threading.Thread(target=read_mid_wait, daemon=True)
    reader.start()
    started = time.perf_counter()
    run_sync(rollout.run(until_drained=True))
    wall = time.perf_counter() - started
    reader.join(5)
    final = rollout.stats.report()
    assert [len(ep.turns) for ep in rollout.take_groups()[0].episodes] == [3, 3]
    # Three 0.3 s steps one after the other: most of the run is waiting, none of it twice.
    assert 0.85 <= final["idle_s"] / 0.9 and final["idle_s"] <= wall
    ended, reading = readings[0]
    assert reading["idle_s"] - ended >= 0.1  # the wait in progress counted, so far
    assert reading["idle_s"] <= reading["clock_s"] - started  # never more than the wall
    assert final["clock_s"] > reading["clock_s"]


def test_a_stuck_env_times_out_and_a_raising_env_fails_with_its_reason(tiny):
    rollout, _ = _loop(tiny, partial(LatencyEnv, [], stuck_seed=7, error_seed=8),
                       group_size=1, env_timeout_s=2.0)  # seed 9's steps: far within it
    for assignment, seed in enumerate([7, 8, 9]):
        rollout.submit(assignment, seed)
    started = time.monotonic()
    run_sync(rollout.run(until_drained=True))
    assert time.monotonic() - started < 20
    by_seed = {g.seed: g.episodes[0] for g in rollout.take_groups()}
    assert by_seed[7].status == "timeout" and by_seed[7].info["reason"] == "env step timed out"
    assert by_seed[8].status == "error"
    assert by_seed[8].info["reason"] == "env step raised ValueError: boom"
    assert by_seed[9].status == "done" and len(by_seed[9].turns) == 3
    # The failed turn's tokens are kept, with their version, and the turn is recorded.
    assert len(by_seed[7].turns) == 1 and by_seed[7].num_policy_tokens > 0


def _policy_versions(episode):
    return [v for v in episode.versions if v != ENV_VERSION]


def test_weights_swapped_mid_run_partial_rollouts_span_versions(tiny):
    rollout, engine = _loop(tiny, partial(LatencyEnv, [], turns=4))

    def before_generate():  # the owner loads new weights: here, a new version at call 3
        if len(engine.calls) == 2:
            engine.load(None, engine.version + 1)

    rollout.before_generate = before_generate
    for assignment in range(3):
        rollout.submit(assignment, 200 + assignment)
    run_sync(rollout.run(until_drained=True))
    episodes = [ep for g in rollout.take_groups() for ep in g.episodes]

    assert len(episodes) == 6 and all(ep.status == "done" for ep in episodes)
    assert all(len(ep.turns) == 4 for ep in episodes)  # partial episodes were continued
    mixed = [ep for ep in episodes if set(_policy_versions(ep)) == {0, 1}]
    assert mixed, "an episode in flight at the swap carries both versions"
    for ep in episodes:
        versions = _policy_versions(ep)
        assert versions == sorted(versions)  # a turn is sampled by one version, never older
    assert rollout.stats.version_swaps == 1


def test_tokens_after_a_mid_episode_swap_are_sampled_by_the_new_weights_alone(tiny):
    """An episode continued across a swap keeps no keys/values computed by the old weights:
    each token's behaviour log-prob is the log-prob of the version it is tagged with,
    scored over the whole episode from scratch."""
    import torch

    from turnrl.models import tiny_model
    from turnrl.trainer.step import UpdateSettings, with_proximal_logprobs
    from turnrl.types import Batch

    old = {k: v.clone() for k, v in tiny[0].state_dict().items()}
    new_model = tiny_model(seed=7)[0]
    rollout, engine = _loop(tiny, partial(LatencyEnv, [], turns=3))

    def before_generate():  # new weights loaded in place before generate call 2
        if len(engine.calls) == 1:
            tiny[0].load_state_dict(new_model.state_dict())
            engine.load(None, engine.version + 1)

    rollout.before_generate = before_generate
    rollout.submit(0, 300)
    run_sync(rollout.run(until_drained=True))
    episodes = rollout.take_groups()[0].episodes
    batch = Batch.from_episodes(episodes, torch.zeros(len(episodes)), tiny[1].pad_token_id)
    cfg = load_config(None, [])
    settings = UpdateSettings(cfg.algo, cfg.optim, 1.0, 6)
    versions = torch.full(batch.input_ids.shape, ENV_VERSION)
    for row, ep in enumerate(episodes):
        versions[row, :len(ep.versions)] = torch.tensor(ep.versions)
    old_model = tiny_model(seed=0)[0]
    old_model.load_state_dict(old)
    for version, model in ((0, old_model), (1, new_model)):
        mask = batch.loss_mask.bool() & (versions == version)
        assert mask.any(), f"no tokens of version {version}"
        scored = with_proximal_logprobs(model, batch, settings).prox_logprobs
        assert torch.allclose(scored[mask], batch.old_logprobs[mask], atol=1e-4), version


def test_without_partial_rollouts_weights_change_only_between_waves(tiny):
    rollout, engine = _loop(tiny, partial(LatencyEnv, [], turns=2), pool_size=2,
                            partial_rollouts=False)
    swaps = []

    def before_generate():  # a newer version is always waiting
        engine.load(None, engine.version + 1)
        swaps.append(engine.version)

    rollout.before_generate = before_generate
    for assignment in range(3):
        rollout.submit(assignment, 300 + assignment)
    run_sync(rollout.run(until_drained=True))
    groups = rollout.take_groups()
    assert len(groups) == 3
    for group in groups:
        versions = {v for ep in group.episodes for v in _policy_versions(ep)}
        assert len(versions) == 1  # one wave, one version
    assert len({g.oldest_version for g in groups}) == 3 and len(swaps) == 3


def test_proximal_logprobs_of_fresh_episodes_match_the_sampled_ones(tiny):
    import torch

    from turnrl.algorithms.offpolicy import behaviour_weights, normalised_ess
    from turnrl.trainer.step import UpdateSettings, with_proximal_logprobs
    from turnrl.types import Batch

    rollout, _ = _loop(tiny, partial(LatencyEnv, [], turns=2))
    for assignment in range(2):
        rollout.submit(assignment, assignment)
    run_sync(rollout.run(until_drained=True))
    episodes = [ep for g in rollout.take_groups() for ep in g.episodes]
    batch = Batch.from_episodes(episodes, torch.zeros(len(episodes)), tiny[1].pad_token_id)
    cfg = load_config(None, ["--optim.micro_batch_size", "3"])
    settings = UpdateSettings(cfg.algo, cfg.optim, 1.0, 6)
    proximal = with_proximal_logprobs(tiny[0], batch, settings).prox_logprobs
    mask = batch.loss_mask.bool()
    assert torch.allclose(proximal[mask], batch.old_logprobs[mask], atol=1e-4)
    assert torch.all(proximal[~mask] == 0)
    weights = behaviour_weights(proximal, batch.old_logprobs)
    assert normalised_ess(weights, mask) == pytest.approx(1.0, abs=1e-6)


# ---- (c) staleness filter and the learner's books (no Ray) --------------------------------------


def _episode(versions, group=0):
    ep = Episode(env="scripted", seed=0, group=group)
    for v in versions:
        ep.append([5], policy=v != ENV_VERSION, logprobs=[-1.0] if v != ENV_VERSION else (),
                  version=v)
    return ep


def _group(assignment, *version_lists, seed=None):
    return Group(assignment, assignment if seed is None else seed,
                 [_episode(v, assignment) for v in version_lists])


def test_staleness_filter_uses_the_oldest_policy_token_of_the_group():
    groups = [
        _group(0, [-1, 3, 3, -1, 5], [-1, 4]),  # oldest 3: 2 behind learner 5, kept
        _group(1, [-1, 2, 5], [-1, 5]),  # oldest 2 (a partial rollout across 3 versions)
        _group(2, [-1, -1]),  # no policy token (env failed at once): nothing stale
        _group(3, [-1, 5], [-1, 1, -1]),  # one old episode makes the whole group stale
        _group(4, [-1, 5, 5]),
    ]
    fresh, stale = split_stale(groups, learner_version=5, max_versions=2)
    assert [g.assignment for g in fresh] == [0, 2, 4]
    assert [g.assignment for g in stale] == [1, 3]
    assert [group_staleness(g, 5) for g in groups] == [2, 3, 0, 4, 0]
    assert groups[1].oldest_version == 2 and groups[2].oldest_version is None
    fresh, stale = split_stale(groups, learner_version=5, max_versions=0)  # on-policy only
    assert [g.assignment for g in fresh] == [2, 4]


def test_group_seeds_are_the_sync_trainers_seeds():
    cfg = load_config(None, ["--rollout.groups_per_step", "3", "--rollout.group_size", "2",
                             "--run.seed", "4"])
    sync = [seed for step in range(3) for seed, _ in training_seeds(cfg, step)[::2]]
    assert [group_seed(cfg, i) for i in range(9)] == sync


def test_the_book_accepts_each_assignment_once_and_finds_lost_ones():
    book = AssignmentBook(lambda index: 1000 + index)
    a, b, c = (book.issue(worker=0, seq=s) for s in (1, 2, 5))
    assert (a.seed, b.seed, c.seed) == (1000, 1001, 1002)
    assert book.deliver(_group(a.id, [0], seed=a.seed))
    assert not book.deliver(_group(a.id, [0], seed=a.seed))  # delivered twice
    assert not book.deliver(_group(99, [0], seed=5))  # never issued
    assert not book.deliver(_group(b.id, [0], seed=77))  # wrong seed for the id
    assert book.duplicates == 3
    # A worker answering a poll sent at seq 4 that knows none of b, c: only b was sent before.
    assert [x.id for x in book.lost(0, known=set(), before_seq=4)] == [b.id]
    book.move(b, worker=1, seq=6)
    assert book.at(1) == [b] and b.reissues == 1
    again = book.issue(worker=1, seq=7, seed=c.seed)  # regenerate: a new id, the same seed
    assert again.id != c.id and again.seed == c.seed and book.next_index == 3


def test_a_revived_worker_gets_an_even_share_of_the_newest_queued_work():
    from turnrl.distributed.book import shared_out

    book = AssignmentBook(lambda index: index)
    for seq in range(1, 8):
        book.issue(worker=0, seq=seq)
    book.issue(worker=1, seq=8)
    # 8 held by workers 0, 1 and the revived 2: 2 each at least; 0's newest move.
    moved = shared_out(book, 2, [0, 1])
    assert {donor: [a.id for a in assignments] for donor, assignments in moved.items()} == {
        0: [6, 5]}
    assert shared_out(book, 1, [0]) == {0: [book.outstanding[i] for i in (6, 5, 4)]}
    assert shared_out(AssignmentBook(lambda index: index), 1, [0]) == {}  # nothing held


class _Handle:
    """Records the actor calls a ``Fleet`` sends (``handle.method.remote(*args)``)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, method):
        return SimpleNamespace(remote=lambda *args: self.calls.append((method, args)))


def test_a_revived_worker_takes_its_share_at_its_first_report_and_the_donor_withdraws():
    from turnrl.distributed.fleet import Fleet
    from turnrl.distributed.workers import WorkerReport

    book = AssignmentBook(lambda index: 100 + index)
    survivor, revived = _Handle(), _Handle()
    fleet = Fleet([survivor, _Handle()], book, respawn=lambda w, n: revived,
                  has_room=lambda w: True)
    fleet.incarnation = {0: "a"}
    for seq in range(1, 7):  # the given-up worker's work, moved to the survivor
        book.issue(worker=0, seq=seq)
    fleet.outages.dead = {1}
    fleet.revive()
    assert fleet.handles[1] is revived and not book.at(1)  # nothing moves before it is up
    fleet.reconcile(1, fleet._next_seq(), WorkerReport(1, "b", [], set(), -1, -1))
    assert [a.id for a in book.at(1)] == [3, 4, 5] and [a.id for a in book.at(0)] == [0, 1, 2]
    assert ("withdraw", ([5, 4, 3],)) in survivor.calls
    none = GroupPlan()  # no schedule, mix or curriculum: the worker's own settings
    assert ("assign", ([(5, 105, none), (4, 104, none), (3, 103, none)],)) in revived.calls
    assert fleet.reissued == [5, 4, 3]
    fleet.reconcile(1, fleet._next_seq(), WorkerReport(1, "b", [], {3, 4, 5}, -1, -1))
    assert len(book.at(1)) == 3 and fleet.reissued == [5, 4, 3]  # once, at its first report


class FakeFleet:
    """Scripted worker reports, for the learner's buffer without Ray."""

    def __init__(self, reports):
        self.reports, self.assigned, self.seq, self.reconciled = list(reports), [], 0, 0
        self.version = {}

    def up(self):
        return [0]

    alive = up

    def _next_seq(self):
        self.seq += 1
        return self.seq

    def assign(self, worker, assignments):
        self.assigned += [(a.id, a.seed) for a in assignments]

    def poll(self, timeout_s):
        return [(0, self._next_seq(), self.reports.pop(0)(self))] if self.reports else []

    def reconcile(self, worker, seq, report):
        self.reconciled += 1


class _Report:
    def __init__(self, groups):
        self.groups, self.stats, self.env_latencies = groups, {}, []


def test_queued_groups_wait_at_the_worker_beyond_its_pool():
    from turnrl.distributed.workers import worker_pool_size

    cfg = load_config(None, ["--rollout.groups_per_step", "2", "--rollout.group_size", "4",
                             "--pool.overprovision", "1.5",
                             "--pool.queued_groups", "2"])
    fleet = FakeFleet([])
    learner = RaySource(cfg, fleet, AssignmentBook(lambda index: index))
    learner.top_up()
    assert in_flight_groups(cfg) == 3 and len(fleet.assigned) == 3 + 2
    assert worker_pool_size(cfg, in_flight_groups(cfg)) == 3 * 4  # the queue is not played
    learner.top_up()
    assert len(fleet.assigned) == 5  # topped up, not added to


def test_the_learner_trains_each_assignment_once_and_regenerates_stale_seeds():
    cfg = load_config(None, ["--rollout.groups_per_step", "2", "--pool.overprovision",
                             "1.5", "--staleness.on_stale", "regenerate",
                             "--staleness.max_versions", "1"])
    book = AssignmentBook(lambda index: 500 + index)
    seeds = {}

    def deliver(ids, version):
        def report(fleet):
            return _Report([_group(i, [-1, version], seed=seeds[i]) for i in ids])
        return report

    fleet = FakeFleet([deliver([0], 0), deliver([0, 1, 2], 0)])
    learner = RaySource(cfg, fleet, book)
    learner.top_up()
    seeds.update(fleet.assigned)
    assert fleet.assigned == [(0, 500), (1, 501), (2, 502)]  # ceil(1.5 * 2) outstanding
    groups = learner.take(2)
    # Assignment 0 arrived twice: trained once. Group 2 waits in the buffer.
    assert [g.assignment for g in groups] == [0, 1] and book.duplicates == 1
    assert [g.assignment for g in learner.buffer.groups] == [2]
    assert [a for a, _ in fleet.assigned[3:]] == [3, 4]  # topped up while the learner trains

    learner.version = 2  # two updates later, buffered group 2 (version 0) is too stale
    seeds.update(fleet.assigned)
    fleet.reports = [deliver([3, 4], 2), deliver([5], 2)]
    groups = learner.take(2)
    assert book.outcome[2] == "regenerated" and learner.ledger.step_events["regenerated"] == [2]
    assert (5, 502) in fleet.assigned  # seed 502 played again under the new id 5
    assert [g.assignment for g in groups] == [3, 4]


def test_the_learner_issues_no_more_groups_than_the_run_can_still_train():
    """A pool sized for a slow spell (a big ``target``) is capped by the steps left: issued
    beyond them, one worker's burst fed a revived worker's run to its end (docs/cluster.md)."""
    cfg = load_config(None, ["--rollout.groups_per_step", "2", "--run.steps", "3"])
    book = AssignmentBook(lambda index: index)

    def deliver(ids):
        return lambda fleet: _Report([_group(i, [-1, 0]) for i in ids])

    fleet = FakeFleet([deliver([0, 1, 2, 3])])
    learner = RaySource(cfg, fleet, book)
    for target in (500, 6, 7):
        learner.sizing.target = target
        learner.top_up()
        assert [a for a, _ in fleet.assigned] == list(range(6))  # 3 steps of 2 groups
    assert [g.assignment for g in learner.take(2)] == [0, 1]
    # Step 0 taken (2 groups buffered, 2 outstanding): while it trains the cap still counts
    # it (at most one step's groups more); once published, 2 steps need the 4 in the system.
    assert [a for a, _ in fleet.assigned] == list(range(8))
    learner.version = 1
    learner.top_up()
    assert len(fleet.assigned) == 8
    learner.version = 3  # the run's last step is done: nothing more to play
    learner.buffer.groups.clear()
    book.outstanding.clear()
    learner.top_up()
    assert len(fleet.assigned) == 8


def test_reports_are_read_every_step_even_while_the_buffer_holds_enough():
    """A report that came in is read at the next step although the buffer could serve it:
    unread, its groups (a revived worker's, after another worker's burst) waited to the
    run's end, and a restart or lost work in it went unnoticed."""
    cfg = load_config(None, ["--rollout.groups_per_step", "2", "--pool.overprovision", "3"])
    seeds = {}

    def deliver(ids):
        return lambda fleet: _Report([_group(i, [-1, 0], seed=seeds[i]) for i in ids])

    fleet = FakeFleet([])
    learner = RaySource(cfg, fleet, AssignmentBook(lambda index: 100 + index))
    learner.top_up()
    seeds.update(fleet.assigned)
    fleet.reports = [deliver([0, 1, 2, 3]), deliver([4])]
    assert [g.assignment for g in learner.take(2)] == [0, 1]
    assert fleet.reconciled == 1 and len(fleet.reports) == 1  # [4] not in yet: no wait
    assert [g.assignment for g in learner.take(2)] == [2, 3]  # the buffer had enough ...
    assert fleet.reconciled == 2 and not fleet.reports  # ... and the report was read
    assert [g.assignment for g in learner.buffer.groups] == [4]


def test_the_sizing_sees_what_the_buffer_will_need_and_the_groups_in_the_system():
    """The bound must not fall under the staleness the buffered groups will have when
    trained (arrival order, ``groups_per_step`` a step from the next version), and its
    Little's-law term counts every group issued and not yet trained."""
    cfg = load_config(None, ["--rollout.groups_per_step", "2", "--staleness.max_versions",
                             "2", "--pool.overprovision", "2"])

    def learner_with_buffer(oldest_version):
        fleet = FakeFleet([])
        fleet.reissued, fleet.restarts, fleet.pool_size = [], 0, 0
        fleet.resize = lambda size: setattr(fleet, "pool_size", size)
        learner = RaySource(cfg, fleet, AssignmentBook(lambda index: index))
        learner.top_up()
        learner.buffer.groups = [_group(100 + i, [-1, oldest_version, 5]) for i in range(5)]
        learner.version = 6  # published: the next collect runs at version 6
        learner.sizing.step_clock = time.perf_counter() - 1.0  # the step took a second
        return learner

    learner = learner_with_buffer(0)
    issued = len(learner.book.outstanding)
    assert learner.sizing.buffered_staleness(learner.buffer.groups, learner.version) == [6, 6, 7, 7, 8]
    metrics = learner.group_metrics(5, [_group(99, [-1, 5])], {"offpolicy/ess": 0.95})
    assert metrics["sizing/max_versions"] >= 8  # keeps all five buffered groups
    assert learner.sizing.max_versions >= 8
    # Young buffered groups (staleness 1-3): the groups in the system alone set the target.
    young = learner_with_buffer(5)
    assert young.sizing.buffered_staleness(young.buffer.groups, young.version) == [1, 1, 2, 2, 3]
    metrics = young.group_metrics(5, [_group(99, [-1, 5])], {"offpolicy/ess": 0.95})
    in_system = issued + 5  # issued (none delivered) and the buffer
    assert metrics["sizing/bound_target"] >= (in_system - 1) // 2 + 1 > 3


# ---- (b), (d) a real local Ray cluster ------------------------------------------------------

TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.progress", "false", "--run.tensorboard", "false", "--run.mode", "async",
        "--optim.lr", "1e-3", "--ray.num_workers", "1", "--rollout.group_size", "4",
        "--rollout.groups_per_step", "2"]


def _books_balance(result):
    """Every assignment handed out ended exactly one way; none was trained twice."""
    trained = [a for a, _ in result.trained]
    assert len(trained) == len(set(trained))
    ends = [set(trained), set(result.dropped), set(result.regenerated), set(result.abandoned),
            set(result.filtered)]
    assert sum(map(len, ends)) == len(set().union(*ends))  # disjoint
    assert set().union(*ends) == set(result.issued)  # nothing lost
    assert all(result.issued[a] == seed for a, seed in result.trained)


@pytest.mark.slow
def test_dynamic_sampling_filters_the_workers_groups_and_takes_more(ray_cluster, tmp_path):
    """DAPO dynamic sampling in async mode: the tiny model rarely says a digit, so most groups
    have equal rewards; they are left out (``filtered`` in the books and the ledger) and more
    groups are taken from the workers, up to ``dynamic_max_rounds`` extra rounds."""
    from turnrl.distributed import LEDGER_FILE
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics

    cfg = load_config(None, TINY + ["--run.steps", "3", "--eval.episodes", "0",
                                    "--explore.dynamic_sampling", "true",
                                    "--explore.dynamic_max_rounds", "2",
                                    "--run.out_dir", str(tmp_path)])
    result = train_async(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    ledger = [json.loads(line) for line in (tmp_path / LEDGER_FILE).read_text().splitlines()]
    for r, line in zip(records, ledger, strict=True):
        # the informative groups it has (none: the first groups_per_step, as sync does)
        assert len(line["trained"]) == (r["dynamic/kept_groups"] or 2)
        assert len(line["filtered"]) == r["dynamic/collected_groups"] - len(line["trained"])
        assert r["dynamic/rounds"] <= 2 and r["dynamic/kept_groups"] <= 2
    assert sum(r["dynamic/dropped_groups"] for r in records) > 0  # the filter had work
    assert sum(r["dynamic/rounds"] for r in records) > 0  # and took more for it
    assert sorted(result.filtered) == sorted(a for line in ledger for a in line["filtered"])
    _books_balance(result)


@pytest.mark.slow
def test_async_training_on_a_local_ray_cluster(ray_cluster, tmp_path):
    from turnrl.distributed import LEDGER_FILE
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics

    cfg = load_config(None, TINY + ["--run.steps", "3", "--eval.episodes", "4",
                                    "--run.checkpoint_every", "2",
                                    "--staleness.adaptive", "true",
                                    "--run.out_dir", str(tmp_path)])
    result = train_async(cfg)

    records = read_metrics(tmp_path / "metrics.jsonl")
    ledger = [json.loads(line) for line in (tmp_path / LEDGER_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [line["step"] for line in ledger] == [1, 2, 3]
    for r, line in zip(records, ledger, strict=True):
        assert math.isfinite(r["loss/policy"]) and math.isfinite(r["grad_norm"])
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 2
        assert r["time/wait_s"] <= r["time/collect_s"]  # waiting for groups is collecting
        assert r["async/dropped_groups"] == len(line["dropped"])  # the ledger tells the same
        assert len(line["trained"]) == 2
        assert {"reward/mean", "success/rate", "async/version_lag",
                "async/worker_restarts", "async/regenerated_groups"} <= r.keys()
        assert 0 < r["staleness/ess"] <= 1 + 1e-6  # the adaptive bound read the update's ESS
        assert r["staleness/ess"] == r["offpolicy/ess"]  # decoupled PPO is on in async mode
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert checkpoints == ["step-000002", "step-000003"]
    for name in ("config.yaml", "eval_before.json", "eval_after.json", "summary.txt",
                 LEDGER_FILE):
        assert (tmp_path / name).exists(), name
    assert len(result.trained) == 3 * 2 and result.after.episodes == 4
    assert "after 3 steps" in result.table
    _books_balance(result)
    deadline = time.monotonic() + 120  # ray.kill returns before the actor is down: loose
    while ray_cluster.util.list_named_actors() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ray_cluster.util.list_named_actors()  # the workers are gone


@pytest.mark.slow
def test_async_training_scores_the_workers_episodes_with_the_reward_model(ray_cluster, tmp_path):
    """``reward.model`` in async mode: the learner scores the groups the Ray worker sends,
    and each trained episode's reward is env_weight * its env reward + model_weight *
    sigmoid(the model's score of its transcript), re-scored here from its saved token ids."""
    from tests.rewards.test_model import save_rm
    from tests.trainer.test_reward_model import assert_rescored
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics

    model_dir = save_rm(tmp_path / "rm")
    cfg = load_config(None, TINY + ["--run.steps", "2", "--eval.episodes", "0",
                                    "--run.checkpoint_every", "0", "--run.sample_episodes", "8",
                                    "--reward.model", str(model_dir),
                                    "--reward.normalise", "sigmoid", "--reward.env_weight",
                                    "0.5", "--reward.model_weight", "2",
                                    "--run.out_dir", str(tmp_path / "run")])
    result = train_async(cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0 < r["reward/model_used_mean"] < 1 and r["reward/model_std"] > 0
        assert r["reward/mean"] == pytest.approx(
            0.5 * r["reward/env_mean"] + 2 * r["reward/model_used_mean"], abs=1e-5)
        assert r["time/reward_model_s"] > 0
    def sigmoid(scores):
        return [1 / (1 + math.exp(-s)) for s in scores]

    assert assert_rescored(tmp_path / "run", model_dir, 0.5, 2, sigmoid) == 2 * 8
    _books_balance(result)


@pytest.mark.slow
def test_tree_rollouts_fork_in_the_workers_loop(ray_cluster, tmp_path):
    """``rollout.branch`` in async mode: the worker's turn loop forks each episode after turn 1
    into 2 continuations (a root that ended at turn 1 does not fork), the copies hold the
    trunk's tokens with a zero loss mask, and the learner credits the leaves over their tree."""
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics
    from turnrl.types import read_episodes

    cfg = load_config(None, TINY[:4] + TINY[6:] + [
        "--env.name", "guess-number", "--rollout.max_turns", "3", "--rollout.group_size", "2",
        "--rollout.branch.turns", "1", "--rollout.branch.k", "2",
        "--algo.advantage", "tree_grpo", "--run.steps", "2", "--eval.episodes", "0",
        "--run.checkpoint_every", "0", "--run.out_dir", str(tmp_path)])
    result = train_async(cfg)
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("step", 0) > 0]
    assert len(steps) == 2 and all(1 < r["tree/leaves_per_root"] <= 2 for r in steps)
    trees: dict[str, list] = {}
    for path in sorted((tmp_path / "episodes").glob("step-*.jsonl")):
        for episode in read_episodes(path):
            if "branch" in episode.info:
                trees.setdefault(episode.info["branch"]["tree"], []).append(episode)
    assert trees and all(len(leaves) == 2 for leaves in trees.values())
    for leaves in trees.values():
        first, second = sorted(leaves, key=lambda e: e.info["branch"]["path"])
        assert [first.info["branch"]["path"], second.info["branch"]["path"]] == [[[1, 0]],
                                                                                 [[1, 1]]]
        shared = second.loss_mask.index(1)  # the copy trains from its own turn 2 on
        assert second.token_ids[:shared] == first.token_ids[:shared]
        assert any(first.loss_mask[:shared])  # the trunk's turn 1, trained by child 0 alone
    _books_balance(result)


@pytest.mark.slow
def test_an_async_run_evaluates_the_base_model_first_then_every_n_versions(ray_cluster,
                                                                           tmp_path):
    """With ``eval.every 2`` over 5 steps, metrics.jsonl holds version 0's held-out row at
    step 0, written before the first update's row, then versions 2 and 4 at their steps; the
    final version is the "after" evaluation. Each row names its weight version, which is the
    learner's version at that step (the version the workers are sent next)."""
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics

    cfg = load_config(None, TINY + ["--run.steps", "5", "--eval.episodes", "3",
                                    "--eval.every", "2", "--run.checkpoint_every", "0",
                                    "--run.out_dir", str(tmp_path)])
    result = train_async(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    evals = [r for r in records if "eval/success" in r]
    assert [(r["step"], r["eval/version"]) for r in evals] == [(0, 0), (2, 2), (4, 4)]
    base = records[0]
    assert "loss/policy" not in base and "eval/learner_s" not in base  # no update yet
    before = json.loads((tmp_path / "eval_before.json").read_text())
    assert base["eval/success"] == before["success_rate"]  # the "before" evaluation itself
    for r in evals:
        assert 0 <= r["eval/success_lo"] <= r["eval/success"] <= r["eval/success_hi"] <= 1
    for r in evals[1:]:
        assert r["eval/learner_s"] > 0 and "loss/policy" in r
    assert result.after.episodes == 3
    _books_balance(result)


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_its_work_reissued(ray_cluster, tmp_path):
    from turnrl.distributed import LEDGER_FILE
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics

    cfg = load_config(None, TINY + ["--run.steps", "4", "--eval.episodes", "0",
                                    "--run.checkpoint_every", "0",
                                    "--env.options.turns", "2",
                                    "--pool.overprovision", "2",
                                    # The restarted actor imports torch and loads the model
                                    # again: at load 5-6 on 2 cores Ray took 155 s to create
                                    # one, past the default 120 s the run waits for it.
                                    "--ray.node_loss_wait_s", "600",
                                    "--run.out_dir", str(tmp_path)])
    killed = []
    trained = threading.Event()

    def kill_after_the_first_step():
        # Bounded by the run, not by a clock: on a busy machine (load 7) the workers' start
        # and the first step took over the 120 s this once allowed.
        metrics = tmp_path / "metrics.jsonl"
        while not trained.is_set():
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                names = [n for n in ray_cluster.util.list_named_actors() if "-rollout-" in n]
                worker = ray_cluster.get_actor(names[0])
                ray_cluster.kill(worker, no_restart=False)  # Ray restarts it
                killed.append(names[0])
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_after_the_first_step)
    killer.start()
    try:
        result = train_async(cfg)
    finally:
        trained.set()
        killer.join()

    assert killed, "the worker was never killed"
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert sum(r["async/worker_restarts"] for r in records) == result.worker_restarts == 1
    # pool.auto (the default) measured and sized from step 1 on, through the restart;
    # the learner's own times from step 2 (its first step is a warm-up, not kept).
    for r in records:
        assert r["rates/turns_per_episode"] >= 1
        assert (r["rates/learner_steps_per_s"] is None) == (r["step"] == 1)
        assert r["step"] == 1 or r["rates/learner_steps_per_s"] > 0
        assert r["sizing/pool"] >= 2 * 4 and r["sizing/max_versions"] >= 1
        assert r["async/staleness_max"] <= r["async/max_versions"]
    assert any(math.isfinite(r["rates/env_latency_median_s"]) for r in records)
    # The restarted worker got back the work it held: same ids, same seeds, each trained
    # (or left over at the end) once; 8 groups trained on, none twice, none lost.
    assert result.reissued
    assert len(result.trained) == 4 * 2
    _books_balance(result)
    trained_seeds = [seed for _, seed in result.trained]
    assert len(set(trained_seeds)) == len(trained_seeds)
    ledger = [json.loads(line) for line in (tmp_path / LEDGER_FILE).read_text().splitlines()]
    assert [(a, seed) for r in ledger for a, seed, _ in r["trained"]] == result.trained
    assert sorted(a for r in ledger for a in r["reissued"]) == sorted(result.reissued)


def test_published_weights_ship_a_tied_matrix_once_and_load_back_whole():
    import torch

    from turnrl.distributed.worker_engines import with_tied_weights, without_tied_weights
    from turnrl.models import tiny_model

    model, _ = tiny_model(seed=0)  # tied like SmolLM2
    state = {k: v.detach() for k, v in model.state_dict().items()}
    shipped = without_tied_weights(state)
    assert len(shipped) == len(state)  # one key fewer, plus the alias map
    assert shipped["__tied__"] == {"lm_head.weight": "model.embed_tokens.weight"}
    other, _ = tiny_model(seed=1)
    other.load_state_dict(with_tied_weights(shipped))  # strict: every key is back
    for key, value in other.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_a_worker_samples_with_the_weights_it_was_sent_last():
    """Each group's behaviour log-probs are the sent model's own, never the previous one's:
    the worker really loads what ``set_weights`` ships, and no cache outlives a swap (the
    two groups share their prompt, so a stale prompt cache would show here)."""
    import torch

    from turnrl.distributed.worker_engines import without_tied_weights
    from turnrl.distributed.workers import RolloutWorker
    from turnrl.models import tiny_model
    from turnrl.trainer.step import UpdateSettings, with_proximal_logprobs
    from turnrl.types import Batch

    cfg = load_config(None, TINY + ["--env.options.turns", "2"])
    settings = UpdateSettings(cfg.algo, cfg.optim, cfg.rollout.temperature, 6)
    models = [tiny_model(seed=seed)[0] for seed in (1, 2)]
    worker = RolloutWorker(cfg, pool_size=8)
    try:
        for version, model in enumerate(models):
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            worker.set_weights(version, without_tied_weights(state))
            worker.assign([(version, 100)])  # the same seed: the same prompts
            episodes = groups_within(worker, 60)[0].episodes
            assert all(set(ep.versions) - {-1} == {version} for ep in episodes)
            batch = Batch.from_episodes(episodes, torch.zeros(len(episodes)),
                                        worker.engine.pad_token_id)
            mask = batch.loss_mask.bool()
            sent, other = (with_proximal_logprobs(m, batch, settings).prox_logprobs[mask]
                           for m in (model, models[1 - version]))
            assert torch.allclose(sent, batch.old_logprobs[mask], atol=1e-4)
            assert not torch.allclose(other, batch.old_logprobs[mask], atol=1e-2)
    finally:
        worker.stop()


def test_a_worker_reports_its_env_latencies_and_takes_a_new_pool_size():
    """What ``pool.auto`` reads and sets at a worker: every env call's wall time comes
    back with the reports (each delayed step at least its delay; the resets, not delayed,
    apart: Little's law spreads an episode's one reset over its turns), and ``resize``
    changes how many episodes live at once."""
    from turnrl.distributed.worker_engines import without_tied_weights
    from turnrl.distributed.workers import RolloutWorker
    from turnrl.models import tiny_model

    slow = {"env": "say-digit", "median_ms": 40, "sigma": 0.0, "options": {"turns": 2}}
    cfg = load_config(None, TINY + ["--env.name", "slow", "--env.options", json.dumps(slow)])
    worker = RolloutWorker(cfg, pool_size=4)  # one group of 4 at a time

    def play(assignments):
        worker.assign(assignments)
        groups, latencies, resets, deadline = [], [], [], time.monotonic() + 60
        rows_before = worker.rollout.stats.generated_rows
        calls = []
        while len(groups) < len(assignments) and time.monotonic() < deadline:
            report = worker.take_groups(wait_s=1.0)
            groups += report.groups
            latencies += report.env_latencies
            resets += report.reset_latencies
            calls += report.call_costs
        assert len(groups) == len(assignments)
        # Every generate call's own size and time came back (what the cost model fits).
        calls += worker.take_groups().call_costs
        assert sum(rows for rows, _ in calls) == report.stats["generated_rows"] - rows_before
        assert all(seconds > 0 for _, seconds in calls)
        assert report.stats["open_groups_at_calls"] > 0
        return groups, latencies, resets, report.stats

    try:
        state = {k: v.detach().clone() for k, v in tiny_model(seed=1)[0].state_dict().items()}
        worker.set_weights(0, without_tied_weights(state))
        groups, latencies, resets, stats = play([(0, 1), (1, 2), (2, 3)])
        turns = sum(len(ep.turns) for g in groups for ep in g.episodes)
        assert len(latencies) == turns and min(latencies) >= 0.04  # every delayed step
        assert len(resets) == 12 and max(resets) < 0.04  # the 12 resets, not delayed
        assert stats["max_live"] == 4
        worker.resize(12)
        groups, _, _, stats = play([(3, 4), (4, 5), (5, 6)])
        assert stats["max_live"] == 12 and worker.engine.max_kept_rows >= 12
    finally:
        worker.stop()


def test_worker_zero_samples_what_the_sync_loop_samples_from_the_same_weights():
    """Common random numbers: worker 0 seeds its sampler like the sync trainer's engine, so
    one group played by both from the same weights is the same group, token for token."""
    import torch

    from turnrl.distributed.worker_engines import sampling_seed, without_tied_weights
    from turnrl.distributed.workers import RolloutWorker
    from turnrl.envs import make_env
    from turnrl.models import tiny_model
    from turnrl.rollout.loop import run_episodes

    cfg = load_config(None, TINY + ["--env.options.turns", "2", "--run.seed", "3"])
    model, tokenizer = tiny_model(seed=1)
    worker = RolloutWorker(cfg, index=0, pool_size=8)
    # The group's turns batched whole, as the sync loop batches them: the 2 ms window that
    # gathers a lone group's env steps into one generate call (BATCH_WINDOW_S) is missed on a
    # machine at load 7, and a turn split over two calls draws other random numbers. What
    # this test checks is the sampler's seeding.
    worker.rollout.lockstep = True
    try:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        worker.set_weights(0, without_tied_weights(state))
        worker.assign([(0, 42)])
        groups = groups_within(worker, 60)
    finally:
        worker.stop()
    chat = ChatFormat(tokenizer)
    params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                            cfg.rollout.top_p, stop_token_ids=(chat.end_of_turn,))
    engine = HFEngine(model, tokenizer.pad_token_id, seed=cfg.run.seed)
    episodes = run_sync(run_episodes(partial(make_env, "say-digit", turns=2),
                                     [(42, 0)] * cfg.rollout.group_size, engine, chat, params))
    assert [ep.token_ids for ep in groups[0].episodes] == [ep.token_ids for ep in episodes]
    assert sampling_seed(cfg.run.seed, 0) == cfg.run.seed
    assert len({sampling_seed(cfg.run.seed, w) for w in range(4)}) == 4
    assert torch.equal(torch.tensor(groups[0].episodes[0].logprobs),
                       torch.tensor(episodes[0].logprobs))


def test_a_vllm_worker_is_given_a_model_directory_it_can_load(monkeypatch):
    """The chooser hands a vLLM worker's engine a directory: the tiny model, built in code,
    saved first (the same weights load back); a local directory as is. vLLM is not on this machine, so a
    stand-in records what it was given (the real one runs in tests/gpu/test_async_vllm_gpu.py)."""
    import torch

    import turnrl.samplers.vllm as vllm_module
    from turnrl.distributed.worker_engines import load_player, sampling_seed
    from turnrl.distributed.workers import worker_sampler
    from turnrl.models import load_model

    given = {}

    class Recorder:
        def __init__(self, path, **kwargs):
            given.update(path=path, **kwargs)

    monkeypatch.setattr(vllm_module, "VLLMEngine", Recorder)
    cfg = load_config(None, TINY + ["--rollout.sampler", "vllm", "--ray.worker_gpus", "1",
                                    "--run.seed", "3"])
    policy, model, engine, _ = worker_sampler(cfg, 1, None)  # the saved directory lives as
    saved_dir = given["path"]  # long as the engine
    assert model is None and given["version"] == -1
    assert given["seed"] == sampling_seed(3, 1) and given["dtype"] == "bfloat16"
    saved, tokenizer = load_model(str(saved_dir))
    ids = torch.tensor([tokenizer("Say a digit.")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(saved(ids).logits, policy.model(ids).logits)
    local = load_config(None, TINY + ["--rollout.sampler", "vllm", "--ray.worker_gpus", "1",
                                      "--model.name", str(saved_dir)])
    assert load_player(local).model is None  # no CPU copy of the weights: vLLM loads its own
    local_engine = worker_sampler(local, 0, None)[2]
    assert given["path"] == saved_dir  # a local directory is used as it is, not copied
    assert not hasattr(local_engine, "model_dir_cleanup")  # and never removed
    engine.model_dir_cleanup()  # the saved one goes with its engine (the worker's stop)
    assert not saved_dir.exists()
