"""Ray rollout workers as the learner's rollout source (``run.mode: async``).

``RaySource`` implements ``turnrl.trainer.learn.RolloutSource`` over a ``Fleet`` of
``RolloutWorker`` actors: it keeps about ``pool.overprovision * groups_per_step``
assignments in play (plus ``pool.queued_groups`` per worker waiting to start the moment
a pool has room: a group is only started whole, and one slow episode holds its group open),
hands the learner the first fresh groups that finish (groups finished beyond a step's need
wait in the staleness buffer, trainer/buffer.py, for the next step), drops or regenerates
stale ones (``on_stale``), and writes ``assignments.jsonl`` (``Ledger``, ledger.py): per
step, which (assignment, seed) pairs were trained on and which were dropped, regenerated or
re-issued. With ``staleness.adaptive`` the staleness bound follows the effective sample
size of the behaviour importance weights. With ``pool.auto`` (the default) a
``SizingController`` (sizing.py) resizes the pool, the queue and the bound every step from
the rates measured here (rates.py), all logged as metrics; ``PoolSizing`` (pool_sizing.py)
holds those rates and applies the decisions.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TextIO

import torch

from turnrl.algorithms.exploration import informative_rounds
from turnrl.algorithms.offpolicy import AdaptiveStaleness
from turnrl.config import Config
from turnrl.distributed.book import (
    Assignment,
    AssignmentBook,
    episodes_per_group,
    in_flight_groups,
)
from turnrl.distributed.broadcaster import WeightBroadcaster
from turnrl.distributed.fleet import Fleet
from turnrl.distributed.ledger import Ledger
from turnrl.distributed.placement import (
    LearnerSeat,
    bundle_placed,
    learner_threads,
    release_placement,
    worker_group,
)
from turnrl.distributed.plan import GroupPlanner
from turnrl.distributed.pool_sizing import PoolSizing
from turnrl.distributed.pool_state import frozen_members, pool_state, saved_members, seed_fleet
from turnrl.distributed.refresh_stats import refresh_metrics
from turnrl.distributed.workers import run_env_factories, spawn_workers, worker_needs
from turnrl.policy import group_seed, publish
from turnrl.rollout.loop import Group
from turnrl.selfplay.pool import pool_after_offer
from turnrl.trainer.bookkeeping import TrainResult
from turnrl.trainer.buffer import StalenessBuffer
from turnrl.trainer.evaluation import evaluate_env
from turnrl.trainer.guidance import Guidance
from turnrl.trainer.learn import SourceDefaults
from turnrl.trainer.local import POOL_STATE, play_seeds
from turnrl.trainer.run import Run
from turnrl.types import Episode


@dataclass
class AsyncTrainResult(TrainResult):
    """``TrainResult`` plus the learner's books: what it trained on, and what else happened."""

    trained: list[tuple[int, int]] = field(default_factory=list)
    """(assignment, seed) of every group trained on, in training order."""
    dropped: list[int] = field(default_factory=list)
    regenerated: list[int] = field(default_factory=list)
    reissued: list[int] = field(default_factory=list)
    """Assignments re-sent because the worker holding them was restarted or given up."""
    abandoned: list[int] = field(default_factory=list)
    """Outstanding (or delivered but unused) when the run ended."""
    filtered: list[int] = field(default_factory=list)
    """Left out by dynamic sampling (``explore.dynamic_sampling``): all rewards equal."""
    duplicates: int = 0
    worker_restarts: int = 0
    issued: dict[int, int] = field(default_factory=dict)
    """Every assignment id handed out in this process -> its seed."""


class RaySource(SourceDefaults):
    """Groups from Ray rollout workers for the learner (see the module docstring). Built with
    only ``cfg``, ``open`` spawns the workers; tests hand in a fleet and a book instead."""

    off_policy = True
    versioned_eval = True  # held-out rows per version, base first: learner's engine, workers go on

    def __init__(self, cfg: Config, fleet=None, book: AssignmentBook | None = None,
                 adaptive: AdaptiveStaleness | None = None, ledger: TextIO | None = None,
                 version: int = 0) -> None:
        self.cfg, self.fleet, self.book = cfg, fleet, book
        self.learner_threads = learner_threads(cfg)
        self.ledger = Ledger(ledger)
        """``assignments.jsonl``, the step's events and the run's totals."""
        self.sizing = PoolSizing(cfg, episodes_per_group(cfg), adaptive)
        """The target, the workers' pools and the staleness bound, from the measured rates."""
        self.refresh_totals: dict[int, dict] = {}
        """Each worker's ``refresh_*`` totals at the last step (ct2 workers)."""
        self.buffer = StalenessBuffer("are the workers generating? (ray list actors)",
                                      on_stale=self._stale)
        self.taken: list[Group] = []
        """The groups of the step being trained."""
        self.version, self.closed = version, False
        self.run: Run | None = None
        self.guidance: Guidance | None = None
        self.guided: dict[str, float] = {}
        """The step's ``dynamic/*`` and ``guide/*`` metrics."""
        self.pool_versions: list[int] | None = (
            [] if cfg.env.outside_opponent() == "pool" else None)
        """The opponent pool's versions (``opponent: pool``): workers hold frozen copies."""
        self.planner = GroupPlanner(cfg)
        """Each group's temperature, mix entry and curriculum level (plan.py)."""
        self.seat: LearnerSeat | None = None
        self.group = None
        """The learner's reservation and the workers' placement group (placement.py)."""

    def open(self, run: Run) -> None:
        """Spawn the workers (they build their models while the learner evaluates) and open
        the books where a resumed run left them. Guidance (``explore.guidance``) runs here, on
        the learner: its engine has the newest weights and its env plays the evaluation, so
        guided episodes are on-policy at the learner's version (docs/guidance.md)."""
        self.run, self.guidance = run, Guidance.for_run(run)
        if self.fleet is not None:  # handed in (tests)
            return
        cfg, resume_state = run.cfg, run.checkpoint_state
        self.cfg, self.sizing.cfg, self.version = cfg, cfg, run.start_step
        self.planner = GroupPlanner(cfg, run.learner.explore.temperature, resume_state)
        self.book = book = AssignmentBook(partial(group_seed, cfg), plan_of=self.planner.plan)
        # Work outstanding when the last run stopped is not re-played: its seeds are skipped.
        book.next_index = resume_state.get("seed_index", 0)
        book.next_id = resume_state.get("next_assignment", 0)
        if cfg.staleness.adaptive:
            self.sizing.adaptive = AdaptiveStaleness.from_config(cfg.staleness)
            if "max_versions" in resume_state:
                self.sizing.adaptive.max_versions = resume_state["max_versions"]
        self.ledger.open(run.run_dir, bool(resume_state), run.start_step)
        # a resumed run's opponent pool (pool_state.py), read before any worker starts
        saved_pool = saved_members(run) if self.pool_versions is not None else None
        if cfg.rollout.sampler == "ct2":  # before any worker starts: one line, not an actor error
            from turnrl.samplers.ct2 import check_architecture

            check_architecture(run.learner.model.config, "rollout.sampler")
        device = next(run.learner.model.parameters()).device
        # The learner's seat first: its GPU is then taken before a worker could be put on it.
        if not (cfg.learner.world_size > 1 and cfg.learner.launcher == "ray"):
            # (Ray-actor ranks hold rank 0's seat in their placement group: learner_ranks.py)
            self.seat = LearnerSeat.take(cfg, device.type == "cuda", device.index or 0)
        try:
            self.group = worker_group(cfg)
        except BaseException:
            release_placement(self.seat, None)
            raise
        spawn = partial(spawn_workers, cfg, env_factory=run_env_factories(cfg),
                        pool_size=self.sizing.worker_pool(in_flight_groups(cfg)),
                        name_prefix=f"turnrl-{os.getpid()}-{int(time.time())}-rollout",
                        group=self.group)

        def respawn(w: int, revival: int):
            return spawn(indices=[w], name_suffix=f"-revived-{revival}")[0]

        broadcaster = None
        if cfg.ray.weight_sync == "broadcast":
            broadcaster = WeightBroadcaster(cfg.ray.weight_sync_timeout_s,
                                            cfg.ray.weight_sync_address)
        wait = cfg.ray.node_loss_wait_s
        self.fleet = Fleet(spawn(), book, None if wait == -1 else wait, worker_needs(cfg),
                           respawn=respawn, has_room=bundle_placed(self.group),
                           broadcaster=broadcaster)
        self.fleet.time_startups()  # ray.node_loss_wait_s auto follows them
        if saved_pool is not None:
            self.pool_versions = seed_fleet(self.fleet, *saved_pool)

    def label(self, cfg: Config) -> str:
        return f"{cfg.env.name} (async)"

    def evaluate(self, run: Run, when: str):
        if when == "after":
            self.close()  # the evaluation needs the cores more than generation does
        return evaluate_env(run, when)

    # ---- the RolloutSource methods -------------------------------------------------------------

    def publish(self, version: int, model: torch.nn.Module) -> None:
        if self.run is not None:  # the learner's own engine: evaluation, hinted play
            publish(self.run.policy.engine, model, version)
        self.sizing.note_model(model)
        self.version = version
        self.fleet.publish(version, model)
        if self.pool_versions is not None:  # the opponent pool's rule, as in sync mode
            kept = pool_after_offer(self.pool_versions, version,
                                    self.cfg.env.opponent_pool_every,
                                    self.cfg.env.opponent_pool_size)
            if kept is not None:
                self.pool_versions = kept
                self.fleet.set_pool(kept)
        self.top_up()  # the workers keep generating while the learner updates

    def wait_ready(self) -> None:
        self.fleet.wait_started(timeout_s=600)

    def collect(self, step: int) -> list[Episode]:
        need, explore = self.cfg.rollout.groups_per_step, self.cfg.explore
        self.taken = self.take(need)
        self.guided = {}
        if explore.dynamic_sampling:  # DAPO's filter on the workers' groups, more taken for it
            def more(_round: int, missing: int) -> list[Group]:
                waited = self.buffer.waited  # take() restarts the wait clock: add the first
                groups = self.take(missing)
                self.buffer.waited += waited
                return groups

            self.taken, left, self.guided = informative_rounds(
                self.taken, more, need, explore.dynamic_max_rounds, lambda g: g.episodes)
            for group in left:
                self.book.resolve(group.assignment, "filtered")
            self.ledger.step_events["filtered"] = [g.assignment for g in left]
            self.planner.record(left, self.book.plans)
        self.planner.record(self.taken, self.book.plans)  # a mix's labels, before guidance
        episodes = [ep for g in self.taken for ep in g.episodes]
        if self.guidance is not None:  # the workers' all-failed groups, guided on the learner
            episodes, guided = self.guidance.apply(
                episodes, self.run, lambda seeds, make: play_seeds(self.run, seeds, make),
                self.planner.make())
            self.guided.update(guided)
        return episodes

    def take(self, need: int) -> list[Group]:
        """The first ``need`` fresh groups (oldest arrivals first)."""
        buffer = self.buffer
        buffer.start_collection(self.version, self.sizing.max_versions)
        if self.sizing.step_clock is None:
            self.sizing.step_clock = time.perf_counter()
        # Reports that came in meanwhile, read even when the buffer holds enough: a report
        # left unread hides its groups (a burst from another worker could then feed every
        # step to the run's end), a restart and lost work until the buffer runs low.
        self._receive(self.fleet.poll(timeout_s=0.0))
        while (groups := buffer.take(need)) is None:
            self.top_up()
            self.absorb_reports(timeout_s=1.0)
            if self.sizing.controller is not None and not self.sizing.rates.learner_steps \
                    and self.sizing.presize(self.fleet):
                self.top_up()
            buffer.check_stall()
        self.top_up()
        return groups

    def absorb_reports(self, timeout_s: float) -> None:
        """The workers' reports that arrive within ``timeout_s``: books reconciled, rates
        observed, delivered groups buffered."""
        buffer = self.buffer
        with buffer.waiting():
            reports = self.fleet.poll(timeout_s=timeout_s)
        self._receive(reports)

    def _receive(self, reports: list) -> None:
        """Each worker report: the fleet's books brought up to date, its rates measured, its
        groups accepted once and buffered."""
        for worker, seq, report in reports:
            self.fleet.reconcile(worker, seq, report)
            self.sizing.rates.observe_worker(worker, report.stats, time.perf_counter(),
                                      getattr(report, "env_latencies", ()),
                                      getattr(report, "call_costs", ()),
                                      getattr(report, "reset_latencies", ()))
            delivered = [g for g in report.groups if self.book.deliver(g)]
            if delivered:
                self.sizing.arrivals(delivered, self.version)
            self.buffer.add(delivered, self.version, self.sizing.max_versions)

    def step_metrics(self, step: int, episodes: list[Episode],
                     update_metrics: dict[str, float]) -> dict[str, float]:
        pool = ({"game/pool_versions": float(len(self.pool_versions))}
                if self.pool_versions is not None else {})
        return {**self.group_metrics(step, self.taken, update_metrics), **self.guided, **pool,
                **self.planner.step_metrics()}

    def group_metrics(self, step: int, groups: list[Group],
                      update_metrics: dict[str, float]) -> dict[str, float]:
        """Metrics of the groups trained at ``step`` (at learner version ``step``), the events
        since the last step, the adaptive bound's decision; one ledger line."""
        fleet, book, events = self.fleet, self.book, self.ledger.step_events
        worker_versions = [fleet.version[w] for w in fleet.alive()
                           if fleet.version.get(w, -1) >= 0]
        dropped = list(self.buffer.step_dropped)
        shipping, pulled = weight_metrics(fleet, self.version)
        metrics = {
            **self.buffer.step_metrics(step, groups, self.sizing.max_versions),
            "async/regenerated_groups": len(events["regenerated"]),
            "async/reissued_groups": len(fleet.reissued),
            "async/duplicate_groups": book.duplicates,
            "async/worker_restarts": fleet.restarts,
            "async/version_lag": step - min(worker_versions) if worker_versions else 0,
            **shipping,
        }
        worker_stats = dict(getattr(fleet, "stats", {}))
        metrics.update(refresh_metrics(worker_stats, self.refresh_totals))
        self.refresh_totals = worker_stats
        metrics.update(self.sizing.after_step(
            update_metrics, len(dropped) + len(events["regenerated"]),
            len(book.outstanding) + len(self.buffer), self.buffer, self.version, fleet))
        self.ledger.record(step, groups, dropped, fleet, book, pulled)
        return metrics

    def state_dict(self) -> dict:
        """Checkpoint extras: where the seed schedule and assignment ids continue; the
        opponent pool's versions and each worker's games drawn (``opponent: pool``)."""
        pool = {}
        if self.pool_versions is not None:
            draws = getattr(self.fleet, "pool_draws", {})
            pool = {POOL_STATE: pool_state(self.pool_versions, [
                draws.get(w, 0) for w in range(self.cfg.ray.num_workers)])}
        return {"seed_index": self.book.next_index, "next_assignment": self.book.next_id,
                "max_versions": self.sizing.max_versions,
                **(self.guidance.state_dict() if self.guidance is not None else {}), **pool,
                **self.planner.state_dict()}

    def frozen_weights(self) -> dict:
        """The pool members' weights by checkpoint name: the newest version is the learner's
        model itself, an older one is built from the object store, and only when the
        checkpoint writes its bytes (pool_state.py)."""
        if not self.pool_versions or self.run is None:
            return {}
        return frozen_members(self.pool_versions, self.version, self.run.learner.model,
                              dict(self.fleet.pool))

    def close(self) -> None:
        """Stop the workers; what is still outstanding or buffered is abandoned."""
        if self.closed or self.fleet is None:
            return
        self.closed = True
        self.fleet.shutdown()
        release_placement(self.seat, self.group)
        self.ledger.close()
        for assignment in self.abandoned():
            if assignment not in self.book.outcome:
                self.book.resolve(assignment, "abandoned")

    def abandoned(self) -> list[int]:
        return sorted(set(self.book.outstanding) | {g.assignment for g in self.buffer.groups})

    def result(self, result: TrainResult) -> AsyncTrainResult:
        """The run's result with the books' totals."""
        ledger = self.ledger
        return AsyncTrainResult(
            **vars(result), trained=ledger.trained, dropped=self.buffer.dropped,
            regenerated=ledger.totals["regenerated"], reissued=ledger.totals["reissued"],
            abandoned=self.abandoned(), filtered=ledger.totals["filtered"],
            duplicates=ledger.totals["duplicates"],
            worker_restarts=ledger.totals["restarts"], issued=dict(self.book.seeds))

    # ---- keeping the workers busy ------------------------------------------------------------

    def top_up(self) -> None:
        """Keep ``target`` groups outstanding (at workers that answer) or buffered, never more
        than the run's remaining steps can train (``PoolSizing.wanted``)."""
        up = self.fleet.up()
        if not up:
            return
        in_flight = sum(a.worker in up for a in self.book.outstanding.values())
        new: dict[int, list[Assignment]] = {}
        for _ in range(self.sizing.wanted(self.version) - in_flight - len(self.buffer)):
            load = {w: sum(a.worker == w for a in self.book.outstanding.values()) for w in up}
            worker = min(up, key=lambda w: load[w])
            seq = self.fleet._next_seq()
            new.setdefault(worker, []).append(self.book.issue(worker, seq))
        for worker, assignments in new.items():
            self.fleet.assign(worker, assignments)

    def _stale(self, groups: list[Group]) -> None:
        """Too stale: play the seed again under a new id (``regenerate``), or drop it."""
        for group in groups:
            if self.cfg.staleness.on_stale == "regenerate":
                up = self.fleet.up() or self.fleet.alive()
                worker = up[group.assignment % len(up)]
                again = self.book.issue(worker, self.fleet._next_seq(), seed=group.seed)
                self.fleet.assign(worker, [again])
                self.book.resolve(group.assignment, "regenerated")
                self.ledger.step_events["regenerated"].append(group.assignment)
            else:
                self.book.resolve(group.assignment, "dropped")
                self.buffer.drop([group])


def weight_metrics(fleet, version: int) -> tuple[dict[str, float], dict[str, int]]:
    """(what shipping ``version`` to the workers cost, weight bytes pulled per node since
    the last step); a test's fleet without a publisher gives zeros."""
    weights = getattr(fleet, "weights", None)
    metrics = {
        # What one version costs to ship to each worker (LoRA: the adapter alone).
        "async/weight_bytes_per_version": getattr(weights, "version_bytes", 0),
        # 1: this version went through the weight group (ray.weight_sync broadcast).
        "async/weights_broadcast": float(version in getattr(weights, "broadcast_versions", ())),
    }
    pulled = fleet.take_pulled() if hasattr(fleet, "take_pulled") else {}
    if pulled:  # Ray pulls a version into a node once; every worker there shares it
        metrics["async/weights_mb_per_node"] = sum(pulled.values()) / len(pulled) / 1e6
        metrics["async/weights_mb_max_node"] = max(pulled.values()) / 1e6
    return metrics, pulled
