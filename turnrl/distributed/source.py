"""Ray rollout workers as the learner's rollout source (``run.mode: async``).

``RaySource`` implements ``turnrl.trainer.learn.RolloutSource`` over a ``Fleet`` of
``RolloutWorker`` actors: it keeps about ``pool.overprovision * groups_per_step``
assignments in play (plus ``pool.queued_groups`` per worker waiting to start the moment
a pool has room: a group is only started whole, and one slow episode holds its group open),
hands the learner the first fresh groups that finish (groups finished beyond a step's need
wait in the staleness buffer, trainer/buffer.py, for the next step), drops or regenerates
stale ones (``on_stale``), and
writes ``assignments.jsonl``: per step, which (assignment, seed) pairs were trained on and
which were dropped, regenerated or re-issued. With ``staleness.adaptive`` the staleness
bound follows the effective sample size of the behaviour importance weights. With
``pool.auto`` (the default) a ``SizingController`` (sizing.py) resizes the pool, the queue
and the bound every step from the rates measured here (rates.py), all logged as metrics.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TextIO

import numpy as np
import torch

from turnrl.algorithms.offpolicy import AdaptiveStaleness
from turnrl.config import Config
from turnrl.devices import available_memory_bytes
from turnrl.distributed.book import (
    Assignment,
    AssignmentBook,
    episodes_per_group,
    in_flight_groups,
)
from turnrl.distributed.broadcaster import WeightBroadcaster
from turnrl.distributed.fleet import Fleet
from turnrl.distributed.placement import (
    LearnerSeat,
    bundle_placed,
    learner_threads,
    release_placement,
    worker_group,
)
from turnrl.distributed.pool_state import frozen_members, pool_state, saved_members, seed_fleet
from turnrl.distributed.rates import MeasuredRates
from turnrl.distributed.refresh_stats import refresh_metrics
from turnrl.distributed.sizing import SizingController, kv_bytes_per_token, pool_memory_cap
from turnrl.distributed.workers import spawn_workers, worker_needs, worker_pool_size
from turnrl.envs import ENVS
from turnrl.metrics import truncate_metrics
from turnrl.policy import group_seed, publish
from turnrl.rollout.loop import Group
from turnrl.selfplay.pool import pool_after_offer
from turnrl.trainer.bookkeeping import TrainResult
from turnrl.trainer.buffer import StalenessBuffer, group_staleness
from turnrl.trainer.evaluation import evaluate_env
from turnrl.trainer.guidance import Guidance
from turnrl.trainer.learn import SourceDefaults
from turnrl.trainer.local import POOL_STATE, play_seeds
from turnrl.trainer.run import Run
from turnrl.types import Episode

LEDGER_FILE = "assignments.jsonl"


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
    duplicates: int = 0
    worker_restarts: int = 0
    issued: dict[int, int] = field(default_factory=dict)
    """Every assignment id handed out in this process -> its seed."""


class RaySource(SourceDefaults):
    """Groups from Ray rollout workers for the learner (see the module docstring). Built with
    only ``cfg``, ``open`` spawns the workers; tests hand in a fleet and a book instead."""

    off_policy = True

    def __init__(self, cfg: Config, fleet=None, book: AssignmentBook | None = None,
                 adaptive: AdaptiveStaleness | None = None, ledger: TextIO | None = None,
                 version: int = 0) -> None:
        self.cfg, self.fleet, self.book, self.adaptive = cfg, fleet, book, adaptive
        self.learner_threads = learner_threads(cfg)
        self.ledger = ledger if ledger is not None else io.StringIO()
        # In flight (the workers' pools) plus queued behind them, buffered groups included.
        self.target = in_flight_groups(cfg) + cfg.pool.queued_groups * cfg.ray.num_workers
        self.rates = MeasuredRates()
        self.group_episodes = episodes_per_group(cfg)
        """Episodes a group holds (self-play: one per seat of each game); pools count these."""
        self.sizing: SizingController | None = None
        if cfg.pool.auto:
            self.sizing = SizingController.start(
                group_size=self.group_episodes, groups_per_step=cfg.rollout.groups_per_step,
                workers=cfg.ray.num_workers, bound=cfg.staleness.max_versions,
                pool=self.worker_pool(in_flight_groups(cfg)) * cfg.ray.num_workers,
                max_pool=1 << 20, ess_floor=cfg.staleness.ess_low,
                ess_high=cfg.staleness.ess_high)
        self.kv_bytes_per_token = 0.0
        self.refresh_totals: dict[int, dict] = {}
        """Each worker's ``refresh_*`` totals at the last step (ct2 workers)."""
        self.step_clock: float | None = None
        self.arrived = 0
        self.buffer = StalenessBuffer("are the workers generating? (ray list actors)",
                                      on_stale=self._stale)
        self.taken: list[Group] = []
        """The groups of the step being trained."""
        self.version = version
        self.step_events: dict[str, list[int]] = {"regenerated": []}
        self.trained: list[tuple[int, int]] = []
        self.totals = {"reissued": [], "regenerated": [], "restarts": 0, "duplicates": 0}
        self.closed = False
        self.run: Run | None = None
        self.guidance: Guidance | None = None
        self.guided: dict[str, float] = {}
        """The step's ``guide/*`` metrics."""
        self.pool_versions: list[int] | None = (
            [] if cfg.env.options.get("opponent") == "pool" else None)
        """The opponent pool's versions (``opponent: pool``): workers hold frozen copies."""
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
        self.cfg, self.version = cfg, run.start_step
        self.book = book = AssignmentBook(partial(group_seed, cfg))
        # Work outstanding when the last run stopped is not re-played: its seeds are skipped.
        book.next_index = resume_state.get("seed_index", 0)
        book.next_id = resume_state.get("next_assignment", 0)
        if cfg.staleness.adaptive:
            self.adaptive = AdaptiveStaleness.from_config(cfg.staleness)
            if "max_versions" in resume_state:
                self.adaptive.max_versions = resume_state["max_versions"]
        ledger_path = run.run_dir / LEDGER_FILE
        if not resume_state:
            ledger_path.unlink(missing_ok=True)
        truncate_metrics(ledger_path, after_step=run.start_step)
        self.ledger = open(ledger_path, "a")  # noqa: SIM115 - closed by close()
        # a resumed run's opponent pool (pool_state.py), read before any worker starts
        saved_pool = saved_members(run) if self.pool_versions is not None else None
        if cfg.rollout.sampler == "ct2":  # before any worker starts: one line, not an actor error
            from turnrl.samplers.ct2 import check_architecture

            check_architecture(run.learner.model.config, "rollout.sampler")
        device = next(run.learner.model.parameters()).device
        # The learner's seat first: its GPU is then taken before a worker could be put on it.
        self.seat = LearnerSeat.take(cfg, device.type == "cuda", device.index or 0)
        try:
            self.group = worker_group(cfg)
        except BaseException:
            release_placement(self.seat, None)
            raise
        spawn = partial(spawn_workers, cfg, env_factory=ENVS.get(cfg.env.name),
                        pool_size=self.worker_pool(in_flight_groups(cfg)),
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

    @property
    def max_versions(self) -> int:
        if self.adaptive:
            return self.adaptive.max_versions
        return self.sizing.bound.value if self.sizing else self.cfg.staleness.max_versions

    # ---- the RolloutSource methods -------------------------------------------------------------

    def publish(self, version: int, model: torch.nn.Module) -> None:
        if self.run is not None:  # the learner's own engine: evaluation, hinted play
            publish(self.run.policy.engine, model, version)
        if not self.kv_bytes_per_token and hasattr(model, "config"):
            element = next(model.parameters()).element_size()
            self.kv_bytes_per_token = kv_bytes_per_token(model.config, element)
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
        self.taken = self.take(self.cfg.rollout.groups_per_step)
        episodes = [ep for g in self.taken for ep in g.episodes]
        self.guided = {}
        if self.guidance is not None:  # the workers' all-failed groups, guided on the learner
            episodes, self.guided = self.guidance.apply(
                episodes, self.run, lambda seeds, make: play_seeds(self.run, seeds, make))
        return episodes

    def take(self, need: int) -> list[Group]:
        """The first ``need`` fresh groups (oldest arrivals first)."""
        buffer = self.buffer
        buffer.start_collection(self.version, self.max_versions)
        if self.step_clock is None:
            self.step_clock = time.perf_counter()
        # Reports that came in meanwhile, read even when the buffer holds enough: a report
        # left unread hides its groups (a burst from another worker could then feed every
        # step to the run's end), a restart and lost work until the buffer runs low.
        self._receive(self.fleet.poll(timeout_s=0.0))
        while (groups := buffer.take(need)) is None:
            self.top_up()
            self.absorb_reports(timeout_s=1.0)
            if self.sizing is not None and not self.rates.learner_steps:
                self._presize()
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
            self.rates.observe_worker(worker, report.stats, time.perf_counter(),
                                      getattr(report, "env_latencies", ()),
                                      getattr(report, "call_costs", ()),
                                      getattr(report, "reset_latencies", ()))
            delivered = [g for g in report.groups if self.book.deliver(g)]
            if delivered:
                self._arrivals(delivered)
            self.buffer.add(delivered, self.version, self.max_versions)

    def step_metrics(self, step: int, episodes: list[Episode],
                     update_metrics: dict[str, float]) -> dict[str, float]:
        pool = ({"game/pool_versions": float(len(self.pool_versions))}
                if self.pool_versions is not None else {})
        return {**self.group_metrics(step, self.taken, update_metrics), **self.guided, **pool}

    def group_metrics(self, step: int, groups: list[Group],
                      update_metrics: dict[str, float]) -> dict[str, float]:
        """Metrics of the groups trained at ``step`` (at learner version ``step``), the events
        since the last step, the adaptive bound's decision; one ledger line."""
        fleet, book, events = self.fleet, self.book, self.step_events
        worker_versions = [fleet.version[w] for w in fleet.alive()
                           if fleet.version.get(w, -1) >= 0]
        dropped = list(self.buffer.step_dropped)
        metrics = {
            **self.buffer.step_metrics(step, groups, self.max_versions),
            "async/regenerated_groups": len(events["regenerated"]),
            "async/reissued_groups": len(fleet.reissued),
            "async/duplicate_groups": book.duplicates,
            "async/worker_restarts": fleet.restarts,
            "async/version_lag": step - min(worker_versions) if worker_versions else 0,
            # What one version costs to ship to each worker (LoRA: the adapter alone).
            "async/weight_bytes_per_version": getattr(fleet, "version_bytes", 0),
            # 1: this version went through the weight group (ray.weight_sync broadcast).
            "async/weights_broadcast": float(self.version in getattr(fleet, "broadcast_versions",
                                                                      ())),
        }
        worker_stats = dict(getattr(fleet, "stats", {}))
        metrics.update(refresh_metrics(worker_stats, self.refresh_totals))
        self.refresh_totals = worker_stats
        pulled = fleet.take_pulled() if hasattr(fleet, "take_pulled") else {}
        if pulled:  # Ray pulls a version into a node once; every worker there shares it
            metrics["async/weights_mb_per_node"] = sum(pulled.values()) / len(pulled) / 1e6
            metrics["async/weights_mb_max_node"] = max(pulled.values()) / 1e6
        if self.adaptive is not None:  # the bound for the next step's groups
            decision = self.adaptive.update(update_metrics.get("offpolicy/ess", float("nan")))
            metrics.update(decision.metrics())
        metrics.update(self._resize(update_metrics, len(dropped)))
        for g in groups:
            book.resolve(g.assignment, "trained")
            self.trained.append((g.assignment, g.seed))
        self.ledger.write(json.dumps({
            "step": step + 1, "trained": [[g.assignment, g.seed, g.worker] for g in groups],
            "dropped": dropped, **events, "reissued": fleet.reissued,
            "worker_restarts": fleet.restarts, "weights_bytes_by_node": pulled}) + "\n")
        self.ledger.flush()
        self.totals["reissued"] += fleet.reissued
        self.totals["regenerated"] += events["regenerated"]
        self.totals["restarts"] += fleet.restarts
        self.totals["duplicates"] += book.duplicates
        fleet.reissued, fleet.restarts, book.duplicates = [], 0, 0
        self.step_events = {"regenerated": []}
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
                "max_versions": self.max_versions,
                **(self.guidance.state_dict() if self.guidance is not None else {}), **pool}

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
        return AsyncTrainResult(
            **vars(result), trained=self.trained, dropped=self.buffer.dropped,
            regenerated=self.totals["regenerated"], reissued=self.totals["reissued"],
            abandoned=self.abandoned(), duplicates=self.totals["duplicates"],
            worker_restarts=self.totals["restarts"], issued=dict(self.book.seeds))

    # ---- sizing from measured rates ----------------------------------------------------------

    def _arrivals(self, groups: list[Group]) -> None:
        """What arriving groups say about lifetimes, staleness and episode length."""
        episodes = [ep for g in groups for ep in g.episodes]
        self.arrived += len(groups)
        self.rates.observe_groups([g.finished_at - g.started_at for g in groups],
                                  [group_staleness(g, self.version) for g in groups],
                                  float(np.mean([len(ep.turns) for ep in episodes])),
                                  float(np.mean([len(ep.token_ids) for ep in episodes])))

    def _resize(self, update_metrics: dict[str, float], dropped: int) -> dict[str, float]:
        """After a step: the learner's rates, then (``pool.auto``) the new pool, queue and
        bound; the rates and the decision as metrics."""
        now = time.perf_counter()
        step_s = now - (self.step_clock or now)
        self.step_clock = now
        self.rates.observe_step(step_s, self.buffer.waited,
                                update_metrics.get("offpolicy/ess", float("nan")))
        metrics = self.rates.metrics()
        if self.sizing is None:
            return metrics
        cap = pool_memory_cap(self.kv_bytes_per_token, self.rates.tokens.value,
                              available_memory_bytes(), self.cfg.pool.memory_fraction)
        decision = self.sizing.update(self.rates, self.arrived,
                                      dropped + len(self.step_events["regenerated"]),
                                      max_pool=cap,
                                      in_system=len(self.book.outstanding) + len(self.buffer),
                                      buffered=self._buffered_staleness())
        self.arrived = 0
        self._apply_pool(decision.pool, decision.queued_groups)
        return {**metrics, **decision.metrics(), "sizing/memory_cap": float(cap)}

    def _buffered_staleness(self) -> list[int]:
        """The staleness each buffered group will have when trained: the buffer is used in
        arrival order, ``groups_per_step`` a step, from version ``self.version`` on."""
        per_step = self.cfg.rollout.groups_per_step
        return [group_staleness(g, self.version + i // per_step)
                for i, g in enumerate(self.buffer.groups)]

    def _presize(self) -> None:
        """Before the first step: the pool for what the workers can generate (``presize``)."""
        before = self.sizing.pool.value
        pool = self.sizing.presize(self.rates)
        if pool is None or pool == before:
            return
        self._apply_pool(pool, self.sizing.queued or self.cfg.pool.queued_groups)
        self.top_up()

    def worker_pool(self, groups: int) -> int:
        """Live episodes a worker keeps for its share of ``groups``."""
        return worker_pool_size(self.cfg, groups, self.group_episodes)

    def _apply_pool(self, pool: int, queued_groups: int) -> None:
        groups = math.ceil(pool / self.group_episodes)
        self.target = (open_groups(pool, self.group_episodes, self.rates.live_per_group())
                       + queued_groups * self.cfg.ray.num_workers)
        size = self.worker_pool(groups)
        if size != self.fleet.pool_size:
            self.fleet.resize(size)

    # ---- keeping the workers busy ------------------------------------------------------------

    def top_up(self) -> None:
        """Keep ``target`` groups outstanding (at workers that answer) or buffered, never more
        than the run's remaining steps can train (``groups_left``)."""
        up = self.fleet.up()
        if not up:
            return
        in_flight = sum(a.worker in up for a in self.book.outstanding.values())
        new: dict[int, list[Assignment]] = {}
        for _ in range(min(self.target, self.groups_left()) - in_flight - len(self.buffer)):
            load = {w: sum(a.worker == w for a in self.book.outstanding.values()) for w in up}
            worker = min(up, key=lambda w: load[w])
            seq = self.fleet._next_seq()
            new.setdefault(worker, []).append(self.book.issue(worker, seq))
        for worker, assignments in new.items():
            self.fleet.assign(worker, assignments)

    def groups_left(self) -> int:
        """Groups the steps still to train need, the one being collected included (at most
        one step's groups more than needed while that step trains). Issued beyond this, a
        pool sized for a slow spell (Little's law over long tool calls) once handed out
        hundreds of groups for a run with 56 left: one worker's burst then fed every step to
        the end, and the other worker's groups were abandoned (docs/cluster.md)."""
        steps_left = max(0, self.cfg.run.steps - self.version)
        return steps_left * self.cfg.rollout.groups_per_step

    def _stale(self, groups: list[Group]) -> None:
        """Too stale: play the seed again under a new id (``regenerate``), or drop it."""
        for group in groups:
            if self.cfg.staleness.on_stale == "regenerate":
                up = self.fleet.up() or self.fleet.alive()
                worker = up[group.assignment % len(up)]
                again = self.book.issue(worker, self.fleet._next_seq(), seed=group.seed)
                self.fleet.assign(worker, [again])
                self.book.resolve(group.assignment, "regenerated")
                self.step_events["regenerated"].append(group.assignment)
            else:
                self.book.resolve(group.assignment, "dropped")
                self.buffer.drop([group])


def open_groups(pool: int, group_size: int, live_per_group: float) -> int:
    """Groups to keep in play for ``pool`` live episodes. A group's ended episodes wait for
    its slowest one (heavy-tailed tools: the group lives ~2x its mean episode), so a group in
    play holds ``live_per_group`` live episodes, measured, not ``group_size``; issuing only
    ``pool / group_size`` groups would leave the workers' pools part empty."""
    if not math.isfinite(live_per_group):
        live_per_group = group_size
    return math.ceil(pool / min(max(live_per_group, 1.0), group_size))
