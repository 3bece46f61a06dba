"""The asynchronous trainer: Ray rollout workers generate while the learner trains.

Two loops run at once (the AReaL design: Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
Reinforcement Learning System for Language Reasoning", arXiv:2505.24298):

- the **rollout loop**, in each worker (turnrl/rollout/continuous.py,
  turnrl/distributed/workers.py): a pool of live episodes continued in batched generate calls,
  environment steps running concurrently, new groups started as old ones finish, and the
  newest weights swapped in between generate calls. With partial rollouts (APRIL: Zhou et al.
  2025, arXiv:2509.18521) an episode in flight keeps going across a weight swap, so its tokens
  can come from several policy versions (``Episode.versions`` records which, per token);
- the **learner loop**, here, in the driver process: wait until ``groups_per_step`` fresh
  enough groups have arrived, compute advantages, run the same ``policy_update`` as the
  synchronous trainer, bump the version, publish the weights (``ray.put`` once per version),
  log and checkpoint. It never waits for a generation to finish, only for enough of them.

Between them sits the **buffer** of the learner's books (``AssignmentBook``): the learner
hands out *assignments* (an id and the seed of one GRPO group), keeping about
``staleness.overprovision * groups_per_step`` of them in play so the workers always have
work (plus ``staleness.queued_groups`` per worker waiting to start the moment a pool has
room: a group is only started whole, and one slow episode holds its group open), and
trains on the first ones that finish (groups finished beyond a step's need wait in the
buffer for the next step). A group is fresh enough while its *oldest* policy token is at
most ``staleness.max_versions`` versions behind the learner (AReaL's bounded staleness,
checked on arrival and again when a buffered group is used); a staler group is dropped
(``on_stale: drop``) or its seed is played again under a new assignment id
(``on_stale: regenerate``). With ``staleness.adaptive`` the bound follows the effective sample
size of the behaviour importance weights (``AdaptiveStaleness``).

Assignments are also what makes worker failures harmless: a worker that dies is restarted by
Ray, and the learner re-issues the assignments it held (same ids, same seeds) once it answers
again; an assignment is accepted at most once, so duplicates are ignored (see
turnrl/distributed/workers.py). ``assignments.jsonl`` in the run directory records, per step,
which (assignment, seed) pairs were trained on and which were dropped, regenerated or
re-issued.

Decoupled PPO is always on here (``algo.decoupled`` is forced): the behaviour
log-probabilities are the ones the workers sampled (``Episode.logprobs``, possibly from several
versions), the proximal ones are the learner's weights right before the update, scored at the
marked hook below; ``policy_update`` keeps the trust region around the proximal policy and
weights each token by proximal / behaviour. Its ESS drives ``staleness.adaptive``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from turnrl.algorithms.advantages import compute_advantages
from turnrl.algorithms.offpolicy import AdaptiveStaleness, staleness
from turnrl.algorithms.turn_credit import TurnCredit, is_turn_level
from turnrl.checkpoint import (
    load_checkpoint,
    load_component,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from turnrl.config import Config, ConfigError, config_to_dict
from turnrl.distributed.workers import without_tied_weights
from turnrl.envs import ENVS
from turnrl.metrics import MetricsLogger, TrainProgress, truncate_metrics
from turnrl.models import configure_torch
from turnrl.rollout.continuous import Group
from turnrl.trainer.step import make_optimizer, policy_update, with_proximal_logprobs
from turnrl.trainer.sync import (
    StageTimer,
    TrainResult,
    _load_or_run_eval,
    before_after_table,
    episode_metrics,
    load_policy,
    periodic_eval,
    prepare_run_dir,
    training_seeds,
    update_settings,
)
from turnrl.types import Batch, write_episodes

LEDGER_FILE = "assignments.jsonl"
POLL_WAIT_S = 0.1
"""How long a worker's ``take_groups`` waits for a group before answering empty."""
WORKER_DOWN_AFTER_S = 120.0
"""A worker failing every call for this long is given up; its work goes to the others."""
STALL_AFTER_S = 900.0
"""No group at all for this long ends the run with an error instead of hanging."""


# ---- the learner's books -----------------------------------------------------------------


def group_seed(cfg: Config, index: int) -> int:
    """Seed of the ``index``-th group handed out: the seeds the sync trainer would play."""
    step, group = divmod(index, cfg.rollout.groups_per_step)
    return training_seeds(cfg, step)[group * cfg.rollout.group_size][0]


def in_flight_groups(cfg: Config) -> int:
    """Groups the workers play at once: ``overprovision`` times a step's need."""
    return math.ceil(cfg.staleness.overprovision * cfg.rollout.groups_per_step)


def group_staleness(group: Group, learner_version: int) -> int:
    """Versions the group's oldest policy token is behind the learner (0: no policy token)."""
    return max((staleness(ep.versions, learner_version) for ep in group.episodes), default=0)


def split_stale(groups: Sequence[Group], learner_version: int, max_versions: int
                ) -> tuple[list[Group], list[Group]]:
    """(fresh, stale): stale groups have a policy token more than ``max_versions`` behind."""
    fresh, stale = [], []
    for group in groups:
        too_old = group_staleness(group, learner_version) > max_versions
        (stale if too_old else fresh).append(group)
    return fresh, stale


@dataclass
class Assignment:
    id: int
    seed: int
    worker: int
    seq: int
    """Submission order of the call that sent it (see ``_Fleet.seq``)."""
    reissues: int = 0


@dataclass
class AssignmentBook:
    """Every assignment the learner hands out: where it is and how it ended.

    An assignment is outstanding from ``issue`` until its first delivery; any later delivery
    of the same id (or one the book never issued) is a duplicate and is refused. Outcomes:
    "trained", "dropped" (too stale), "regenerated" (too stale, seed re-issued under a new
    id), "abandoned" (outstanding, or delivered and unused, when the run ended).
    """

    seed_of: Callable[[int], int]
    next_index: int = 0
    """Seed index of the next new group (regenerated groups reuse a seed instead)."""
    next_id: int = 0
    outstanding: dict[int, Assignment] = field(default_factory=dict)
    seeds: dict[int, int] = field(default_factory=dict)
    outcome: dict[int, str] = field(default_factory=dict)
    duplicates: int = 0

    def issue(self, worker: int, seq: int, seed: int | None = None) -> Assignment:
        if seed is None:
            seed = self.seed_of(self.next_index)
            self.next_index += 1
        assignment = Assignment(self.next_id, seed, worker, seq)
        self.next_id += 1
        self.outstanding[assignment.id] = assignment
        self.seeds[assignment.id] = seed
        return assignment

    def deliver(self, group: Group) -> bool:
        """Accept a delivered group once; False for a duplicate or unknown one."""
        assignment = self.outstanding.get(group.assignment)
        if assignment is None or assignment.seed != group.seed:
            self.duplicates += 1
            return False
        del self.outstanding[group.assignment]
        return True

    def resolve(self, assignment: int, outcome: str) -> None:
        if assignment in self.outcome:
            raise RuntimeError(f"assignment {assignment} already {self.outcome[assignment]}")
        self.outcome[assignment] = outcome

    def at(self, worker: int) -> list[Assignment]:
        return [a for a in self.outstanding.values() if a.worker == worker]

    def lost(self, worker: int, known: set[int], before_seq: int) -> list[Assignment]:
        """Outstanding at ``worker``, sent before ``before_seq``, and unknown to it."""
        return [a for a in self.at(worker) if a.seq < before_seq and a.id not in known]

    def move(self, assignment: Assignment, worker: int, seq: int) -> None:
        assignment.worker, assignment.seq = worker, seq
        assignment.reissues += 1


# ---- the rollout workers, seen from the learner ---------------------------------------------


class _Fleet:
    """The worker handles, their in-flight polls, and what the learner knows of each."""

    def __init__(self, handles: list, book: AssignmentBook):
        import ray

        self.ray = ray
        self.handles = handles
        self.book = book
        self.seq = 0
        """Counts calls sent to workers. Ray runs one caller's calls to an actor in order, so
        an assignment sent before a poll was sent is known to the worker when it answers."""
        self.polls: dict[int, tuple[object, int]] = {}
        self.incarnation: dict[int, str] = {}
        self.version: dict[int, int] = {}
        self.weights_seq: dict[int, int] = {}
        self.down_since: dict[int, float] = {}
        self.retry_at: dict[int, float] = {}
        self.failures: dict[int, int] = {}
        self.dead: set[int] = set()
        self.weights: tuple[int, object] | None = None
        self.fired: list = []
        # Events since the learner last looked (it logs them per step).
        self.restarts = 0
        self.reissued: list[int] = []
        self.stats: dict[int, dict] = {}

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _fire(self, ref) -> None:
        """A call whose answer we never need; kept so a failure does not go unobserved."""
        self.fired.append(ref)
        if len(self.fired) > 64:
            done, self.fired = self.ray.wait(self.fired, num_returns=len(self.fired),
                                             timeout=0)
            for ref in done:
                try:
                    self.ray.get(ref)
                except self.ray.exceptions.RayActorError:
                    pass  # the poll path notices dead workers

    def up(self) -> list[int]:
        return [w for w in range(len(self.handles))
                if w not in self.dead and w not in self.down_since]

    def alive(self) -> list[int]:
        return [w for w in range(len(self.handles)) if w not in self.dead]

    def wait_started(self, timeout_s: float) -> None:
        """Block until every worker has built its model (a constructor error raises here)."""
        refs = [h.ping.remote() for h in self.handles]
        try:
            incarnations = self.ray.get(refs, timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the rollout workers did not start within {timeout_s:.0f} s; does the cluster "
                "have the CPUs/GPUs they reserve (ray.worker_cpus, ray.worker_gpus) free? "
                "see `ray status`") from None
        for w, incarnation in enumerate(incarnations):
            self.incarnation[w] = incarnation

    def publish(self, version: int, model: torch.nn.Module) -> None:
        # Tied tensors are found on the model's device (copies to the CPU no longer alias).
        state = without_tied_weights({k: v.detach() for k, v in model.state_dict().items()})
        state = {k: v.to("cpu") if torch.is_tensor(v) else v for k, v in state.items()}
        self.weights = (version, self.ray.put(state))  # once per version, for all workers
        for w in self.alive():
            self.send_weights(w)

    def send_weights(self, w: int) -> None:
        version, ref = self.weights
        self._fire(self.handles[w].set_weights.remote(version, [ref]))
        self.weights_seq[w] = self._next_seq()

    def assign(self, w: int, assignments: list[Assignment]) -> None:
        self._fire(self.handles[w].assign.remote([(a.id, a.seed) for a in assignments]))

    def poll(self, timeout_s: float) -> list[tuple[int, int, object]]:
        """Reports that arrived within ``timeout_s``: ``(worker, poll seq, WorkerReport)``."""
        now = time.monotonic()
        for w in self.alive():
            if w not in self.polls and now >= self.retry_at.get(w, 0.0):
                ref = self.handles[w].take_groups.remote(None, POLL_WAIT_S)
                self.polls[w] = (ref, self._next_seq())
        if not self.polls:
            time.sleep(timeout_s)
            return []
        refs = [ref for ref, _ in self.polls.values()]
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        ready = set(ready)
        reports = []
        for w, (ref, seq) in list(self.polls.items()):
            if ref not in ready:
                continue
            del self.polls[w]
            try:
                reports.append((w, seq, self.ray.get(ref)))
            except self.ray.exceptions.RayActorError as err:
                self._failed(w, err)
        return reports

    def _failed(self, w: int, err: Exception) -> None:
        now = time.monotonic()
        self.failures[w] = self.failures.get(w, 0) + 1
        since = self.down_since.setdefault(w, now)
        self.retry_at[w] = now + min(2.0, 0.1 * 2 ** self.failures[w])
        if now - since < WORKER_DOWN_AFTER_S:
            return
        self.dead.add(w)  # given up: its assignments go to the workers still alive
        others = self.up() or self.alive()
        if not others:
            raise RuntimeError(f"every rollout worker is down (the last error: {err})") from err
        for i, assignment in enumerate(self.book.at(w)):
            target = others[i % len(others)]
            self.book.move(assignment, target, self._next_seq())
            self.assign(target, [assignment])
            self.reissued.append(assignment.id)

    def reconcile(self, w: int, seq: int, report) -> None:
        """Bring a worker up to date after its report: restarts, lost weights, lost work."""
        self.down_since.pop(w, None)
        self.failures.pop(w, None)
        if self.incarnation.get(w, report.incarnation) != report.incarnation:
            self.restarts += 1
        self.incarnation[w] = report.incarnation
        self.version[w] = report.version
        self.stats[w] = report.stats
        if self.weights and report.weights_version < self.weights[0] \
                and self.weights_seq.get(w, seq) < seq:
            self.send_weights(w)  # sent before this poll, yet missing: lost in a restart
        known = report.known | {g.assignment for g in report.groups}
        lost = self.book.lost(w, known, seq)
        if lost:  # re-issued with the same ids and seeds, after the weights
            resend = self._next_seq()
            for assignment in lost:
                self.book.move(assignment, w, resend)
                self.reissued.append(assignment.id)
            self.assign(w, lost)

    def shutdown(self) -> None:
        for handle in self.handles:
            try:
                self.ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


# ---- the learner ---------------------------------------------------------------------------


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


class _Learner:
    """Collects fresh groups for each step from the fleet (the buffer lives here)."""

    def __init__(self, cfg: Config, fleet: _Fleet, book: AssignmentBook,
                 staleness_bound: AdaptiveStaleness | None):
        self.cfg = cfg
        self.fleet = fleet
        self.book = book
        self.adaptive = staleness_bound
        # In flight (the workers' pools) plus queued behind them, buffered groups included.
        self.target = (in_flight_groups(cfg)
                       + cfg.staleness.queued_groups * cfg.ray.num_workers)
        self.buffer: list[Group] = []
        self.version = 0
        self.step_events: dict[str, list[int]] = {"dropped": [], "regenerated": []}
        self.last_group_at = 0.0

    @property
    def max_versions(self) -> int:
        return self.adaptive.max_versions if self.adaptive else self.cfg.staleness.max_versions

    def top_up(self) -> None:
        """Keep ``target`` groups outstanding (at workers that answer) or buffered."""
        up = self.fleet.up()
        if not up:
            return
        in_flight = sum(a.worker in up for a in self.book.outstanding.values())
        new: dict[int, list[Assignment]] = {}
        for _ in range(self.target - in_flight - len(self.buffer)):
            load = {w: sum(a.worker == w for a in self.book.outstanding.values()) for w in up}
            worker = min(up, key=lambda w: load[w])
            seq = self.fleet._next_seq()
            new.setdefault(worker, []).append(self.book.issue(worker, seq))
        for worker, assignments in new.items():
            self.fleet.assign(worker, assignments)

    def _stale(self, groups: list[Group]) -> None:
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
                self.step_events["dropped"].append(group.assignment)

    def collect(self, need: int) -> tuple[list[Group], float]:
        """The first ``need`` fresh groups (oldest arrivals first); seconds spent waiting."""
        self.buffer, stale = split_stale(self.buffer, self.version, self.max_versions)
        self._stale(stale)
        waited = 0.0
        self.last_group_at = time.monotonic()
        while len(self.buffer) < need:
            self.top_up()
            started = time.perf_counter()
            reports = self.fleet.poll(timeout_s=1.0)
            waited += time.perf_counter() - started
            for worker, seq, report in reports:
                self.fleet.reconcile(worker, seq, report)
                delivered = [g for g in report.groups if self.book.deliver(g)]
                if delivered:
                    self.last_group_at = time.monotonic()
                fresh, stale = split_stale(delivered, self.version, self.max_versions)
                self.buffer += fresh
                self._stale(stale)
            if time.monotonic() - self.last_group_at > STALL_AFTER_S:
                raise RuntimeError(f"no rollout group arrived for {STALL_AFTER_S:.0f} s; "
                                   "are the workers generating? (ray list actors)")
        groups, self.buffer = self.buffer[:need], self.buffer[need:]
        self.top_up()  # the workers keep generating while the learner updates
        return groups, waited


def _connect(cfg: Config) -> bool:
    """Join (``ray.address``) or start a local Ray cluster; True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, log_to_driver=False)
    else:
        # Workers' own CPUs are reserved logically; on a small machine they may oversubscribe.
        cpus = max(os.cpu_count() or 1, math.ceil(cfg.ray.num_workers * cfg.ray.worker_cpus))
        # log_to_driver=False: worker start-up chatter would break the progress bar; worker
        # errors still reach the learner as exceptions from its calls.
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    return True


def _learner_threads(cfg: Config) -> int:
    """Torch threads of the learner process.

    On a local cluster the learner and the workers share this machine's cores: each worker
    runs ``int(worker_cpus)`` threads, the learner gets what is left. On a 2-core laptop
    with one worker that is 1 thread each: 2 processes on 2 cores, where torch's default of
    one thread per core in every process would put 4 busy threads on 2 cores and thrash.
    """
    threads = cfg.run.threads or (os.cpu_count() or 1)
    if cfg.ray.address:  # the workers run elsewhere (or say so by their own reservations)
        return threads
    cores = os.cpu_count() or 1
    workers = cfg.ray.num_workers * max(1, int(cfg.ray.worker_cpus))
    return max(1, min(threads, cores - workers))


def train_async(cfg: Config, *, resume: bool = False) -> AsyncTrainResult:
    """Train with Ray rollout workers and this process as the learner (``run.mode: async``).

    Same run directory as ``train``: config.yaml, metrics.jsonl, episodes/, checkpoints/,
    eval_before/eval_after on the learner's model, summary.txt; plus assignments.jsonl.
    """
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("run.mode async needs Ray: pip install 'turnrl[ray]'")
    import ray

    cfg, checkpoint = prepare_run_dir(cfg, resume)
    run_dir = Path(cfg.run.out_dir)
    ledger_path = run_dir / LEDGER_FILE
    if checkpoint is None:
        ledger_path.unlink(missing_ok=True)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)

    started_ray = _connect(cfg)
    fleet = None
    try:
        configure_torch(_learner_threads(cfg))
        policy = load_policy(cfg)  # also checks the chat template and the env, before Ray work
        model, tokenizer, engine = policy.model, policy.tokenizer, policy.engine
        ref_model = copy.deepcopy(model).eval() if cfg.algo.kl_coef > 0 else None
        optimizer = make_optimizer(model, cfg.optim)
        settings = update_settings(cfg, model)
        # Off-policy data needs the decoupled objective (algo.decoupled: "always on in async").
        settings = replace(settings, algo=replace(settings.algo, decoupled=True))
        credit = (TurnCredit(cfg.algo, model.config.hidden_size, seed=cfg.run.seed)
                  if is_turn_level(cfg.algo.advantage) else None)
        adaptive = AdaptiveStaleness.from_config(cfg.staleness) if cfg.staleness.adaptive \
            else None
        book = AssignmentBook(partial(group_seed, cfg))
        start_step = 0
        if checkpoint is not None:
            state, rng = load_checkpoint(checkpoint, model, optimizer)
            restore_rng(rng, engine.generator)
            start_step = engine.version = state["step"]
            # Work outstanding when the last run stopped is not re-played: its seeds are skipped.
            book.next_index = state.get("seed_index", 0)
            book.next_id = state.get("next_assignment", 0)
            if adaptive is not None and "max_versions" in state:
                adaptive.max_versions = state["max_versions"]
            if credit is not None and (saved := load_component(checkpoint, "credit")) is not None:
                credit.load_state_dict(saved)
            print(f"resuming {run_dir} from step {start_step}")
        else:
            print(f"run directory: {run_dir}")
        truncate_metrics(run_dir / "metrics.jsonl", after_step=start_step)
        truncate_metrics(ledger_path, after_step=start_step)

        # Workers start (seconds: a process, imports, a model) while the learner evaluates.
        from turnrl.distributed.workers import spawn_workers, worker_pool_size

        handles = spawn_workers(
            cfg, env_factory=ENVS.get(cfg.env.name),
            pool_size=worker_pool_size(cfg, in_flight_groups(cfg)),
            name_prefix=f"turnrl-{os.getpid()}-{int(time.time())}-rollout")
        fleet = _Fleet(handles, book)
        learner = _Learner(cfg, fleet, book, adaptive)
        learner.version = start_step
        fleet.publish(learner.version, model)
        learner.top_up()

        before = _load_or_run_eval(run_dir / "eval_before", policy.run_eval, cfg.eval.episodes)
        fleet.wait_started(timeout_s=600)
        tensorboard = cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is not None
        logger = MetricsLogger(run_dir, tensorboard=tensorboard, wandb=cfg.run.wandb,
                               wandb_project=cfg.run.wandb_project, config=config_to_dict(cfg))
        episodes_dir = run_dir / "episodes"
        episodes_dir.mkdir(exist_ok=True)
        trained: list[tuple[int, int]] = []
        totals = {"reissued": [], "dropped": [], "regenerated": [], "restarts": 0,
                  "duplicates": 0}

        with logger, open(ledger_path, "a") as ledger, TrainProgress(
                cfg.run.steps, start_step=start_step, enabled=cfg.run.progress,
                description=f"{cfg.env.name} (async)", length_unit="turns") as progress:
            for step in range(start_step, cfg.run.steps):
                timer = StageTimer()
                step_start = time.perf_counter()
                with timer("collect"):
                    groups, waited = learner.collect(cfg.rollout.groups_per_step)
                    episodes = [ep for g in groups for ep in g.episodes]
                    lags = [group_staleness(g, learner.version) for g in groups]
                    ep_lags = [staleness(ep.versions, learner.version) for ep in episodes]
                    worker_versions = [fleet.version[w] for w in fleet.alive()
                                       if fleet.version.get(w, -1) >= 0]
                    version_lag = (learner.version - min(worker_versions) if worker_versions
                                   else 0)
                with timer("score"):
                    rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float32)
                    group_ids = torch.tensor([ep.group for ep in episodes])  # assignment ids
                with timer("advantages"):  # turn-level credit may also train its critic here
                    advantages = (credit.advantages(model, episodes, tokenizer.pad_token_id)
                                  if credit is not None
                                  else compute_advantages(cfg.algo.advantage, rewards,
                                                          group_ids))
                    batch = Batch.from_episodes(episodes, advantages, tokenizer.pad_token_id)
                # ---- HOOK(decoupled PPO): the proximal log-probs -------------------------
                # Behaviour log-probs: batch.old_logprobs, what the workers sampled (per
                # token, possibly from several versions). Proximal: the learner's weights
                # right now, before this update, one no-grad scoring pass. policy_update
                # keeps the trust region around them and weights tokens by prox / behaviour.
                # With one epoch the update's own forward pass (before its optimiser step)
                # gives them, detached, and this pass is skipped (10-21% of learner time).
                if settings.algo.epochs > 1:
                    with timer("proximal"):
                        batch = with_proximal_logprobs(model, batch, settings)
                # -------------------------------------------------------------------------
                with timer("update"):
                    update_metrics = policy_update(model, optimizer, batch, settings, ref_model)
                    learner.version += 1
                    engine.version = learner.version  # the learner's own (eval) engine cache
                with timer("publish"):
                    fleet.publish(learner.version, model)
                with timer("log"):
                    events = learner.step_events
                    summary, metrics = episode_metrics(episodes)
                    metrics = {
                        **metrics,
                        **update_metrics,
                        **(credit.metrics() if credit is not None else {}),
                        "async/staleness_mean": float(np.mean(ep_lags)),
                        "async/staleness_max": max(lags),
                        # Start to delivery of a trained group: with the step rate, the
                        # staleness that throughput implies (Little's law, see README).
                        "async/group_lifetime_s": float(np.mean(
                            [g.finished_at - g.started_at for g in groups])),
                        "async/mixed_version_episodes": float(np.mean(
                            [len(set(ep.versions) - {-1}) > 1 for ep in episodes])),
                        "async/dropped_groups": len(events["dropped"]),
                        "async/regenerated_groups": len(events["regenerated"]),
                        "async/reissued_groups": len(fleet.reissued),
                        "async/duplicate_groups": book.duplicates,
                        "async/worker_restarts": fleet.restarts,
                        "async/version_lag": version_lag,
                        "async/buffered_groups": len(learner.buffer),
                        "async/max_versions": learner.max_versions,
                        "time/wait_s": waited,
                    }
                    if adaptive is not None:  # the bound for the next step's groups
                        decision = adaptive.update(update_metrics.get("offpolicy/ess",
                                                                      float("nan")))
                        metrics.update(decision.metrics())
                    for g in groups:
                        book.resolve(g.assignment, "trained")
                        trained.append((g.assignment, g.seed))
                    ledger.write(json.dumps({
                        "step": step + 1,
                        "trained": [[g.assignment, g.seed, g.worker] for g in groups],
                        **events, "reissued": fleet.reissued,
                        "worker_restarts": fleet.restarts}) + "\n")
                    ledger.flush()
                    totals["reissued"] += fleet.reissued
                    totals["dropped"] += events["dropped"]
                    totals["regenerated"] += events["regenerated"]
                    totals["restarts"] += fleet.restarts
                    totals["duplicates"] += book.duplicates
                    fleet.reissued, fleet.restarts, book.duplicates = [], 0, 0
                    learner.step_events = {"dropped": [], "regenerated": []}
                    if cfg.run.sample_episodes:
                        write_episodes(episodes_dir / f"step-{step + 1:06d}.jsonl",
                                       episodes[:cfg.run.sample_episodes])
                metrics.update(periodic_eval(cfg, policy, step))
                metrics.update({f"time/{k}_s": v for k, v in timer.seconds.items()})
                metrics["time/step_s"] = time.perf_counter() - step_start
                logger.log(step + 1, metrics)
                progress.update(step + 1, reward=summary.mean_reward, turns=summary.mean_turns,
                                success=f"{summary.success_rate:.0%}",
                                stale=f"{metrics['async/staleness_mean']:.1f}")
                last = step + 1 == cfg.run.steps
                if last or (cfg.run.checkpoint_every
                            and (step + 1) % cfg.run.checkpoint_every == 0):
                    save_checkpoint(run_dir, step + 1, model, optimizer,
                                    rng=rng_state(engine.generator), keep=cfg.run.keep_checkpoints,
                                    extra={"seed_index": book.next_index,
                                           "next_assignment": book.next_id,
                                           "max_versions": learner.max_versions},
                                    components=None if credit is None
                                    else {"credit": credit.state_dict()})

        fleet.shutdown()  # the after-evaluation needs the cores more than idle generation
        abandoned = sorted(set(book.outstanding) | {g.assignment for g in learner.buffer})
        for assignment in abandoned:
            book.resolve(assignment, "abandoned")
        after = _load_or_run_eval(run_dir / "eval_after", policy.run_eval, cfg.eval.episodes,
                                  fresh=True)
        table = before_after_table(cfg, run_dir, before, after)
        return AsyncTrainResult(
            run_dir, cfg.run.steps, before, after, table, trained=trained,
            dropped=totals["dropped"], regenerated=totals["regenerated"],
            reissued=totals["reissued"], abandoned=abandoned,
            duplicates=totals["duplicates"], worker_restarts=totals["restarts"],
            issued=dict(book.seeds))
    finally:
        if fleet is not None:
            fleet.shutdown()
        if started_ray:
            ray.shutdown()
