"""Rollout workers: thin Ray actors around the continuous turn loop.

Each ``RolloutWorker`` is a process with its own copy of the policy model, its own engine and
its own environments; it runs ``TurnLoop`` (turnrl/rollout/loop.py) in a
background thread with its own asyncio loop, so the actor's methods stay responsive while it
generates. The learner (the driver process, turnrl/trainer/learn.py, through turnrl/distributed/source.py) talks to it through
five calls, all cheap:

- ``set_weights(version, [state_dict_ref])``: the learner ``ray.put``s its state dict once per
  version and sends every worker the *reference* (wrapped in a list, so Ray does not fetch it
  eagerly). The worker remembers only the newest; right before its next generate call it
  fetches that one from the object store, loads it and bumps ``engine.version`` (which drops
  the HF engine's KV cache, computed with the old weights). Versions that were superseded
  before the worker got to them are never fetched.
- ``assign([(assignment, seed), ...])``: groups to play; the learner picks the seeds.
- ``take_groups(max, wait_s)``: finished groups (a short long-poll), plus what the learner
  needs to reconcile its books: every assignment the worker still holds, the weights version
  it has, and an *incarnation* id that changes when Ray restarts the actor.
- ``ping()``: the incarnation, to wait for start-up (and surface a constructor error).
- ``withdraw([assignment, ...])``: drop those still queued; the learner moved them to a
  revived worker (``Fleet.share``).

Why each worker holds its own model copy: generation and training run at the same time in
different processes (possibly on different machines and GPUs), and generation needs one
consistent snapshot of the weights while the optimiser rewrites the learner's. A process
cannot sample from another process's tensors, and sharing one model would put generation
back in lock-step with the update, which is exactly what the asynchronous trainer removes.
The price is one model's memory per worker and one object-store transfer per version a
worker actually loads.

On GPUs (``rollout.sampler: vllm``, ``ray.worker_gpus`` > 0) the worker samples with a
``VLLMEngine`` on the GPU Ray assigned it, and a version is loaded by vLLM's own weight loader,
in place (``VLLMEngine.load``, which also drops its prefix cache unless
``sampler.keep_kv_cache``); the learner's
state dict travels through the object store, or with ``ray.weight_sync: broadcast`` through a
torch.distributed group (``join_weight_group``, ``receive_weights``; weight_sync.py): over
NCCL it stays on the GPU and vLLM reads it through CUDA IPC. Not run here: the development
machine has no GPU (``tests/gpu/test_async_vllm_gpu.py`` and ``tests/gpu/test_weight_broadcast_gpu.py``
skip without one).

On CPUs, ``rollout.sampler: ct2`` samples with a ``CT2Engine`` (CTranslate2, int8 by default), and
a version is converted by a thread of the worker's own while the engine keeps sampling with
the previous one (``turnrl/samplers/ct2_refresh.py``): ``set_weights`` offers it, and the swap
happens right before a generate call, so each call's tokens carry the version that sampled
them. The conversion and the sampling's wait on it come back with every report.

What happens when a worker dies: the actors are started with ``max_restarts=-1``, so Ray
starts a fresh process that runs ``__init__`` again (new model copy, empty pool, new
incarnation, no weights yet: it waits for the learner's before generating anything). Calls in
flight or made while it restarts fail with ``RayActorError`` (``ActorUnavailableError``); the
learner catches them, stops handing that worker new work, and retries. The first report of
the new incarnation shows weights and assignments missing; the learner re-sends the newest
weights and re-issues the missing assignments, with the same ids and seeds, to the restarted
worker. Every group carries its (assignment, seed), and the learner accepts an assignment
only once, so a late or repeated delivery is ignored: no episode is lost or counted twice.
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from turnrl.config import Config
from turnrl.distributed.cluster import WorkerSetup, node_label, uploaded, worker_runtime_env
from turnrl.distributed.placement import worker_options
from turnrl.distributed.weight_sync import (
    Layout,
    WeightReceiver,
    device_identity,
    weights_digest,
)
from turnrl.distributed.worker_engines import (
    ct2_refresh,
    fetched_state,
    load_player,
    planned_env_factories,
    sampling_seed,
    with_tied_weights,
    worker_env_factory,
)
from turnrl.envs.base import ENVS
from turnrl.envs.user_module import load_env_module, module_of
from turnrl.lora import load_published, published_state
from turnrl.models import configure_torch
from turnrl.policy import load_policy
from turnrl.rollout.loop import Group, TurnLoop, run_sync
from turnrl.samplers import chooser
from turnrl.samplers.base import SamplingParams
from turnrl.selfplay.opponents import FrozenPolicy
from turnrl.selfplay.pool import OpponentPool


@dataclass
class WorkerReport:
    """One ``take_groups`` answer."""

    worker: int
    incarnation: str
    """Random id of this actor process; a new one means Ray restarted the worker."""
    groups: list[Group]
    known: set[int]
    """Assignments the worker still holds (queued, playing, finished and not yet taken)."""
    version: int
    """Policy version the worker generates with now (-1 before it loaded any weights)."""
    weights_version: int
    """Newest version it has been sent (-1: none)."""
    stats: dict[str, float] = field(default_factory=dict)
    env_latencies: list[float] = field(default_factory=list)
    """Seconds of each env step that ended since the last report."""
    reset_latencies: list[float] = field(default_factory=list)
    """Seconds of each env reset that ended since the last report."""
    call_costs: list[tuple[int, float]] = field(default_factory=list)
    """(rows, seconds) of each generate call since the last report."""
    node: tuple[str, str] = ("", "")
    """(Ray node id, 'host (ip)') the worker runs on."""
    logs: list[str] = field(default_factory=list)
    """Warnings and errors the worker logged since the last report (the learner logs them)."""
    pool_draws: int = 0
    """Games its opponent pool has drawn (``opponent: pool``; saved with checkpoints)."""


class RolloutWorker:
    """One rollout worker; a plain class, made a Ray actor by ``spawn_workers``.

    ``env_factory`` is the learner's ``ENVS[cfg.env.name]`` (a mix: ``{name: factory}`` of
    its entries, ``run_env_factories``), registered here under the same name: environments registered at run time in the driver (a script, a test's conftest)
    then exist in the worker too. Ray pickles it, by reference for an importable module and
    by value for ``__main__``; the worker must be able to import whatever it references.
    """

    def __init__(self, cfg: Config, index: int = 0, env_factory: Any = None,
                 pool_size: int | None = None, threads: int | None = None,
                 setup: WorkerSetup | None = None) -> None:
        self.index = index
        self.incarnation = uuid.uuid4().hex
        self.logs = WarningTap.install()
        self.node = (_node_id(), node_label())
        if setup is not None:  # on another node: turnrl's version, files, model directory
            cfg = setup.apply(cfg, index)
        # One thread per reserved CPU: torch's default (one per core of the machine) would
        # oversubscribe the cores the learner and the other workers run on.
        configure_torch(threads or max(1, int(cfg.ray.worker_cpus)))
        load_env_module(cfg.env.module, shipped=True)  # by name: its file came in py_modules
        if isinstance(env_factory, dict):
            ENVS.update({k: f for k, f in env_factory.items() if f is not None})
        elif env_factory is not None:
            ENVS[cfg.env.name] = env_factory
        policy, self.model, self.engine, self.refresh = worker_sampler(cfg, index, pool_size)
        """``refresh`` (ct2): the ``BackgroundRefresh`` converting each version while the
        engine samples; ``model`` None where the engine holds the weights (ct2, vLLM)."""
        self.engine.keep_cache_across_versions = cfg.sampler.keep_kv_cache
        if self.model is not None:  # the HF engine: version -1, nothing the learner sent yet
            self.engine.load(None, -1)  # (ct2 and vLLM are built at -1)
        print(chooser.sampler_line(self.engine, f"rollout worker {index}"), flush=True)
        self._weights_lock = threading.Lock()
        self._loading = threading.Lock()
        self._newest: tuple[int, Any] | None = None
        self._have_weights = threading.Event()
        self._stopping = False
        self.receiver: WeightReceiver | None = None
        """Its side of the weight group (``ray.weight_sync: broadcast``), once joined."""
        params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                                cfg.rollout.top_p, stop_token_ids=(policy.chat.end_of_turn,))
        self.pool = (OpponentPool(policy.chat, params, size=cfg.env.opponent_pool_size,
                                  every=cfg.env.opponent_pool_every,
                                  seed=sampling_seed(cfg.run.seed, index))
                     if cfg.env.outside_opponent() == "pool" else None)
        players: dict[str, Any] = {}  # an outside opponent built once, for every env
        self.rollout = TurnLoop(
            worker_env_factory(cfg, self.pool, players=players), self.engine, policy.chat,
            params, group_size=cfg.rollout.group_size, pool_size=pool_size,
            env_name=cfg.env.name, max_turns=cfg.rollout.max_turns,
            max_context=policy.max_context, env_timeout_s=cfg.rollout.env_timeout_s,
            before_generate=self._load_newest_weights,
            partial_rollouts=cfg.staleness.partial_rollouts, worker=index,
            branch=cfg.rollout.branch_plan())  # tree rollouts fork in the worker's loop
        self.planned = planned_env_factories(cfg, self.pool, players)
        """(mix entries' envs, curriculum levels' envs): what an assignment's plan names."""
        self.rollout.seats.record_versions = True  # which weights played each seat of a game
        self._thread = threading.Thread(target=self._serve, name=f"rollout-{index}",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            run_sync(self.rollout.run())
        except BaseException:  # noqa: BLE001 - kept in rollout.error, raised by take_groups
            pass

    def _load_newest_weights(self) -> None:
        """Before each generate call: load the newest version sent, if it is not loaded yet."""
        while not self._have_weights.wait(0.1):  # never generate with weights not sent
            if self._stopping:
                return
        if self.refresh is not None:  # ct2: converted in the background; adopted here
            self.refresh.swap(lambda: self._stopping)
            return
        with self._weights_lock:
            version, state = self._newest
        if version == self.engine.version:
            return
        state = fetched_state(state)  # fetched only now, and only the newest
        if self.model is None:  # vLLM: its own loader, in place
            self.engine.load(state, version, share_cuda=True)
            return
        with self._loading:
            load_published(self.model, state)  # LoRA: the adapter alone
            self.engine.load(None, version)  # its tensors changed: stale caches dropped

    # ---- actor methods -------------------------------------------------------------------

    def __repr__(self) -> str:  # Ray names the actor by this in its errors
        return f"rollout worker {self.index}"

    def ping(self) -> str:
        return self.incarnation

    def set_weights(self, version: int, state_dict_ref: Any) -> int:
        """Remember the newest weights: ``[ObjectRef]`` of a state dict, or a state dict."""
        with self._weights_lock:
            if self._newest is None or version > self._newest[0]:
                self._newest = (version, state_dict_ref)
        if self.refresh is not None:
            self.refresh.offer(version, state_dict_ref)  # converted now, off the sampling path
        self._have_weights.set()
        return version

    def set_pool(self, members: list[tuple[int, Any]], draws: int = 0) -> list[int]:
        """Hold the learner's opponent pool: ``(version, [ObjectRef] or state dict)`` each, a
        frozen copy of the model with those weights built for a version not held yet.
        ``draws``: games this worker's pool had drawn before (a restart, a resumed run): the
        count, which seeds each game's draw, goes on from there, never back."""
        if self.pool is None:
            raise RuntimeError("set_pool: this worker plays no opponent pool "
                               "(env.options.opponent is not pool)")
        states = dict(members)
        with self.pool.changed:
            self.pool.draws = max(self.pool.draws, int(draws))
        self.pool.hold([version for version, _ in members],
                       lambda version: frozen_member(self.model, self.pool, version,
                                                     states[version]))
        return self.pool.versions()

    def assign(self, assignments: list[tuple]) -> int:
        """Queue ``(assignment, seed)`` or ``(assignment, seed, GroupPlan)`` groups: a plan's
        temperature, mix entry and curriculum level are the learner's for that group."""
        entries, levels = self.planned
        for assignment, seed, *planned in assignments:
            plan = planned[0] if planned else None
            make = temperature = None
            if plan is not None:
                temperature = plan.temperature
                if plan.entry is not None:
                    make = entries[plan.entry]
                elif plan.level is not None:
                    make = levels[plan.level]
            self.rollout.submit(assignment, seed, make=make, temperature=temperature)
        return len(assignments)

    def withdraw(self, assignments: list[int]) -> list[int]:
        """Drop queued assignments the learner moved to another worker (``Fleet.share``)."""
        return self.rollout.withdraw(assignments)

    def take_groups(self, max_groups: int | None = None, wait_s: float = 0.0) -> WorkerReport:
        """Finished groups (waiting up to ``wait_s`` for one) and the worker's state."""
        if self.rollout.error is not None:
            raise self.rollout.error  # the loop crashed: a bug or a broken env, not a restart
        if self.refresh is not None:
            self.refresh.check()  # a version that failed to convert, before any call met it
        groups = self.rollout.take_groups(max_groups, wait_s)
        with self._weights_lock:
            sent = self._newest[0] if self._newest is not None else -1
        return WorkerReport(self.index, self.incarnation, groups,
                            self.rollout.known_assignments(), self.engine.version, sent,
                            {**self.rollout.stats.report(),
                             **(self.refresh.stats() if self.refresh is not None else {})},
                            _drained(self.rollout.env_latencies),
                            call_costs=_drained(self.rollout.call_costs),
                            reset_latencies=_drained(self.rollout.reset_latencies),
                            node=self.node, logs=_drained(self.logs.lines),
                            pool_draws=self.pool.draws if self.pool is not None else 0)

    def resize(self, pool_size: int) -> int:
        """A new target of live episodes (``pool.auto``); the loop admits or lets drain
        from its next iteration, and the HF engine keeps that many episodes' caches."""
        self.rollout.pool_size = max(1, pool_size)
        if self.model is not None:
            self.engine.max_kept_rows = max(self.engine.max_kept_rows, pool_size)
        self.rollout._poke()  # room for queued groups now, not at the next env step
        return pool_size

    # ---- ray.weight_sync: broadcast (weight_sync.py) -------------------------------------------

    def weights_device(self) -> tuple[str, str]:
        """Where this worker keeps its weights: ('cuda', GPU UUID) or ('cpu', '')."""
        return device_identity(self._home_device())

    def _home_device(self) -> torch.device:
        if self.model is not None:
            return next(self.model.parameters()).device
        if torch.cuda.is_available():  # vLLM on the GPU Ray gave this actor
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def join_weight_group(self, address: str, port: int, rank: int, world: int, backend: str,
                          generation: int, timeout_s: float) -> str:
        """Join the learner's weight group; '' or why it failed (blocks until all joined)."""
        device = self._home_device() if backend == "nccl" else torch.device("cpu")
        self.receiver = self.receiver or WeightReceiver(device)
        self.receiver.device = device
        return self.receiver.join(address, port, rank, world, backend, generation, timeout_s)

    def receive_weights(self, version: int, generation: int, layout: Layout) -> bool:
        """Take part in the broadcast of ``version``; it is loaded before the next generate."""
        state = self.receiver.receive(generation, layout) if self.receiver else None
        if state is not None:
            self.set_weights(version, state)
        return state is not None

    def newest_weights_digest(self) -> tuple[int, str, list[str]]:
        """(newest version sent, SHA-256 of its tensors, the devices they are on): what the
        next generate call loads."""
        with self._weights_lock:
            version, state = self._newest if self._newest is not None else (-1, {})
        if isinstance(state, list):
            import ray

            state = ray.get(state[0])
        devices = sorted({str(t.device.type) for t in state.values() if torch.is_tensor(t)})
        return version, weights_digest(with_tied_weights(state)), devices

    def load_newest(self) -> int:
        """Load the newest version sent now, not at the next generate call (benchmarks); the
        version the engine then has."""
        self._load_newest_weights()
        return self.engine.version

    def pool_digests(self) -> tuple[int, dict[int, str]]:
        """(games its opponent pool has drawn, version -> SHA-256 of each member's published
        tensors): what its pool games play against."""
        if self.pool is None:
            return 0, {}
        return self.pool.draws, {m.version: weights_digest(published_state(m.model))
                                 for m in self.pool.members}

    def loaded_weights_digest(self) -> tuple[int, str]:
        """(version it samples with, SHA-256 of its model's published tensors); HF engine."""
        with self._loading:
            return self.engine.version, weights_digest(published_state(self.model))

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self._stopping = True
        if self.pool is not None:
            self.pool.close()  # a game waiting for the pool's first member stops waiting
        self.rollout.stop()
        if self.refresh is not None:
            self.refresh.close()
        self._thread.join(timeout=10)
        cleanup = getattr(self.engine, "model_dir_cleanup", None)
        if cleanup is not None:  # vLLM: the tiny model's temporary directory (model_dirs.py)
            cleanup()


def worker_sampler(cfg: Config, index: int, pool_size: int | None
                   ) -> tuple[Any, torch.nn.Module | None, Any, Any]:
    """(policy, model, engine, ct2 refresh) of rollout worker ``index``, its engine built by
    the chooser (``chooser.for_run``) with the worker's sampling seed: vLLM holds the weights
    on the GPU (no CPU copy of the model, only what plays it); ct2 converts them in a
    background thread (the model gives the architecture; weights come later; no HF model to
    play, so no opponent pool: the config checks refuse it); both start at version -1,
    nothing the learner sent yet. hf samples the worker's own copy of the learner's model,
    with the learner's chat and env checks."""
    who, seed = f"rollout worker {index}", sampling_seed(cfg.run.seed, index)
    if cfg.rollout.sampler in ("vllm", "ct2"):
        policy = load_player(cfg) if cfg.rollout.sampler == "vllm" else load_policy(
            cfg, announce=False)
        engine = chooser.for_run(cfg, policy.model, policy.tokenizer, who=who, seed=seed,
                                 version=-1, worker=True, max_context=policy.max_context)
        refresh = ct2_refresh(cfg, engine, index) if cfg.rollout.sampler == "ct2" else None
        return policy, None, engine, refresh
    policy = load_policy(cfg, announce=False, who=who)
    if pool_size is not None:
        # Every live episode's cache must survive until its next turn: a smaller bound
        # evicts rows the pool still needs and re-prefills them (7.8 vs 15.3 ms a row).
        policy.engine.max_kept_rows = max(policy.engine.max_kept_rows, pool_size)
    policy.engine.generator.manual_seed(seed)
    return policy, policy.model, policy.engine, None


def frozen_member(model: torch.nn.Module, pool: OpponentPool, version: int,
                  state: Any) -> FrozenPolicy:
    """A frozen copy of ``model`` with the weights the learner sent for pool ``version``
    (``[ObjectRef]`` or a state dict; LoRA: the adapter alone)."""
    if isinstance(state, list):  # [ObjectRef]
        import ray

        state = ray.get(state[0])
    player = FrozenPolicy(model, pool.chat, pool.params, version, pool.seed)
    load_published(player.model, with_tied_weights(state))
    return player


class WarningTap(logging.Handler):
    """Keeps the worker's warnings and errors (``logging`` and ``warnings.warn``) for its
    next report: with ``log_to_driver`` off (it breaks the progress bar) they would stay in
    the node's Ray log files. The newest 100 are kept."""

    _installed: WarningTap | None = None

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: deque[str] = deque(maxlen=100)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        except Exception:  # noqa: BLE001 - a bad log call must not break the worker
            pass

    @classmethod
    def install(cls) -> WarningTap:
        """One tap per process, on the root logger (a restarted worker is a new process)."""
        if cls._installed is None:
            cls._installed = cls()
            logging.getLogger().addHandler(cls._installed)
            logging.captureWarnings(True)
        return cls._installed


def _node_id() -> str:
    try:
        import ray

        # Not initialized: outside Ray, where get_runtime_context would start a cluster.
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - outside Ray (tests build workers directly)
        return ""


def _drained(pending: deque) -> list:
    """Everything in ``pending``, emptied; popleft is atomic, so the loop's thread may append
    meanwhile."""
    taken = []
    while pending:
        taken.append(pending.popleft())
    return taken


def spawn_workers(cfg: Config, *, env_factory: Any = None, pool_size: int | None = None,
                  threads: int | None = None, name_prefix: str | None = None,
                  group: Any = None, indices: list[int] | None = None,
                  name_suffix: str = "") -> list:
    """Start ``cfg.ray.num_workers`` restartable ``RolloutWorker`` actors; return handles.

    With ``name_prefix`` the actors are named ``{name_prefix}-{i}`` (visible in
    ``ray list actors``; ``ray.get_actor`` finds them). ``max_task_retries=0``: a call that
    was in flight when a worker died fails instead of running twice; the learner reconciles.
    Worker ``i`` goes in bundle ``i`` of ``group`` (``placement.worker_group``) when given.
    ``indices`` starts only those workers (a given-up one revived, named with ``name_suffix``).
    """
    import ray

    actor = ray.remote(RolloutWorker)
    sent, setup = WorkerSetup.of(cfg)
    factories = env_factory.values() if isinstance(env_factory, dict) else [env_factory]
    shipped = [*factories, module_of(cfg.env.module)]  # the env(s), and env.module's envs
    runtime_env = uploaded(worker_runtime_env(cfg, shipped))
    handles = []
    for index in range(cfg.ray.num_workers) if indices is None else indices:
        options: dict[str, Any] = {"max_restarts": -1, "max_task_retries": 0,
                                   **worker_options(cfg, group, index)}
        if runtime_env:
            options["runtime_env"] = runtime_env
        if name_prefix:
            options["name"] = f"{name_prefix}-{index}{name_suffix}"
        handles.append(actor.options(**options).remote(sent, index, env_factory, pool_size,
                                                        threads, setup))
    return handles


def run_env_factories(cfg: Config) -> Any:
    """What ``spawn_workers`` ships of the learner's registry: ``ENVS[env.name]``, or a mix's
    ``{name: factory}`` of its entries (registered at run time in the driver, they exist in
    the workers too)."""
    mix = cfg.env.mix_plan()
    if mix:
        return {e.name: ENVS.get(e.name) for e in mix}
    return ENVS.get(cfg.env.name)


def worker_needs(cfg: Config) -> dict[str, float]:
    """The resources one worker reserves, as ``ray status`` names them."""
    return {"CPU": cfg.ray.worker_cpus, "GPU": cfg.ray.worker_gpus,
            **{k: float(v) for k, v in cfg.ray.worker_resources.items()}}


def worker_pool_size(cfg: Config, outstanding_groups: int, group_episodes: int | None = None
                     ) -> int:
    """Episodes a worker keeps live: its share of the learner's outstanding groups, each of
    ``group_episodes`` episodes (default ``rollout.group_size``; a game of several seats gives
    one episode per seat: ``book.episodes_per_group``)."""
    share = math.ceil(outstanding_groups / cfg.ray.num_workers)
    return max(1, share) * (group_episodes or cfg.rollout.group_size)
