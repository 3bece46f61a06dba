"""Rollout workers: thin Ray actors around the continuous turn loop.

Each ``RolloutWorker`` is a process with its own copy of the policy model, its own engine and
its own environments; it runs ``TurnLoop`` (turnrl/rollout/loop.py) in a
background thread with its own asyncio loop, so the actor's methods stay responsive while it
generates. The learner (the driver process, turnrl/trainer/learn.py, through turnrl/distributed/source.py) talks to it through
four calls, all cheap:

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

Why each worker holds its own model copy: generation and training run at the same time in
different processes (possibly on different machines and GPUs), and generation needs one
consistent snapshot of the weights while the optimiser rewrites the learner's. A process
cannot sample from another process's tensors, and sharing one model would put generation
back in lock-step with the update, which is exactly what the asynchronous trainer removes.
The price is one model's memory per worker and one object-store transfer per version a
worker actually loads.

On GPUs (``ray.engine: vllm``, ``ray.worker_gpus`` > 0) the worker samples with a
``VLLMEngine`` on the GPU Ray assigned it, and a version is loaded by vLLM's own weight loader,
in place (``VLLMEngine.update_weights``, which also drops its prefix cache unless
``staleness.keep_kv_cache``); the learner's
state dict still travels through the object store. Not run here: the development machine has
no GPU (``tests/test_async_vllm_gpu.py`` skips without one).

On CPUs, ``ray.engine: ct2`` samples with a ``CT2Engine`` (CTranslate2, int8 by default), and
a version is converted by a thread of the worker's own while the engine keeps sampling with
the previous one (``turnrl/rollout/ct2_refresh.py``): ``set_weights`` offers it, and the swap
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
import tempfile
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from turnrl.config import Config
from turnrl.distributed.cluster import WorkerSetup, node_label, uploaded, worker_runtime_env
from turnrl.distributed.placement import worker_options
from turnrl.envs.base import ENVS, make_env
from turnrl.lora import base_copy, load_published, vllm_lora_config
from turnrl.models import configure_torch, model_directory
from turnrl.policy import load_policy, use_chat_template
from turnrl.rollout import ChatFormat
from turnrl.rollout.engine import SamplingParams
from turnrl.rollout.loop import Group, TurnLoop, run_sync


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


class RolloutWorker:
    """One rollout worker; a plain class, made a Ray actor by ``spawn_workers``.

    ``env_factory`` is the learner's ``ENVS[cfg.env.name]``, registered here under the same
    name: environments registered at run time in the driver (a script, a test's conftest)
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
        if env_factory is not None:
            ENVS[cfg.env.name] = env_factory
        self.refresh: Any = None
        """ct2: the ``BackgroundRefresh`` converting each version while the engine samples."""
        if cfg.ray.engine == "vllm":
            # vLLM holds the weights on the GPU: no CPU copy of the model, only what plays it.
            policy = load_player(cfg)
            self.model, self.engine = None, vllm_engine(cfg, policy, index)
        elif cfg.ray.engine == "ct2":
            policy = load_policy(cfg)  # the model gives the architecture; weights come later
            self.model = None
            self.engine, self.refresh = ct2_engine(cfg, policy.model, index)
        else:
            policy = load_policy(cfg)  # the same model, chat and env checks as the learner
            self.model, self.engine = policy.model, policy.engine
            self.engine.reuse_cache = cfg.rollout.reuse_cache
            if pool_size is not None:
                # Every live episode's cache must survive until its next turn: a smaller bound
                # evicts rows the pool still needs and re-prefills them (7.8 vs 15.3 ms a row).
                self.engine.max_kept_rows = max(self.engine.max_kept_rows, pool_size)
            self.engine.generator.manual_seed(sampling_seed(cfg.run.seed, index))
        self.engine.keep_cache_across_versions = cfg.staleness.keep_kv_cache
        self.engine.version = -1  # nothing the learner sent yet
        self._weights_lock = threading.Lock()
        self._newest: tuple[int, Any] | None = None
        self._have_weights = threading.Event()
        self._stopping = False
        params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                                cfg.rollout.top_p, stop_token_ids=(policy.chat.end_of_turn,))
        self.rollout = TurnLoop(
            partial(make_env, cfg.env.name, **cfg.env.options), self.engine, policy.chat,
            params, group_size=cfg.rollout.group_size, pool_size=pool_size,
            env_name=cfg.env.name, max_turns=cfg.rollout.max_turns,
            max_context=policy.max_context, env_timeout_s=cfg.rollout.env_timeout_s,
            before_generate=self._load_newest_weights,
            partial_rollouts=cfg.staleness.partial_rollouts, worker=index)
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
            self.engine.update_weights(state, version)
            return
        load_published(self.model, state)  # LoRA: the adapter alone
        self.engine.version = version  # also invalidates the engine's KV cache

    # ---- actor methods -------------------------------------------------------------------

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

    def assign(self, assignments: list[tuple[int, int]]) -> int:
        for assignment, seed in assignments:
            self.rollout.submit(assignment, seed)
        return len(assignments)

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
                            {**self.rollout.report(),
                             **(self.refresh.stats() if self.refresh is not None else {})},
                            _drained(self.rollout.env_latencies),
                            call_costs=_drained(self.rollout.call_costs),
                            reset_latencies=_drained(self.rollout.reset_latencies),
                            node=self.node, logs=_drained(self.logs.lines))

    def resize(self, pool_size: int) -> int:
        """A new target of live episodes (``pool.auto``); the loop admits or lets drain
        from its next iteration, and the HF engine keeps that many episodes' caches."""
        self.rollout.pool_size = max(1, pool_size)
        if self.model is not None:
            self.engine.max_kept_rows = max(self.engine.max_kept_rows, pool_size)
        self.rollout._poke()  # room for queued groups now, not at the next env step
        return pool_size

    def stop(self) -> None:
        self._stopping = True
        self.rollout.stop()
        if self.refresh is not None:
            self.refresh.close()
        self._thread.join(timeout=10)


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

        if not ray.is_initialized():  # built outside Ray (tests): never join a cluster here
            return ""
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray (tests build workers directly)
        return ""


def _drained(pending: deque) -> list:
    """Everything in ``pending``, emptied; popleft is atomic, so the loop's thread may append
    meanwhile."""
    taken = []
    while pending:
        taken.append(pending.popleft())
    return taken


@dataclass
class Player:
    """What a vLLM worker needs besides vLLM: the chat format and the context length (and,
    for the tiny model only, the model itself, to save it where vLLM can load it)."""

    tokenizer: Any
    chat: ChatFormat
    max_context: int | None
    model_dir: Path | None
    model: Any = None


def load_player(cfg: Config) -> Player:
    """The chat side of the policy without its weights (vLLM loads its own copy on the GPU);
    the same chat-template and environment checks as ``load_policy``."""
    from transformers import AutoConfig, AutoTokenizer

    path = model_directory(cfg.model.name, cfg.model.cache_dir or None, cfg.model.revision)
    if path is None:  # tiny: built in code, nothing to load it from
        policy = load_policy(replace(cfg, model=replace(cfg.model, device="cpu")))
        return Player(policy.tokenizer, policy.chat, policy.max_context, None, policy.model)
    trust = cfg.model.trust_remote_code
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    use_chat_template(tokenizer, cfg.model.chat_template)
    chat = ChatFormat(tokenizer)
    chat.check()
    make_env(cfg.env.name, **cfg.env.options)
    max_context = getattr(AutoConfig.from_pretrained(path, trust_remote_code=trust), "max_position_embeddings", None)
    return Player(tokenizer, chat, max_context, path)


def engine_dtype(cfg: Config) -> str:
    """The rollout engine's dtype: ``ray.engine_dtype``, where 'auto' is bfloat16 on GPUs
    (FlashAttention needs 16-bit weights) whatever the learner trains in."""
    return "bfloat16" if cfg.ray.engine_dtype == "auto" else cfg.ray.engine_dtype


def sampling_seed(run_seed: int, worker: int) -> int:
    """Seed of a worker's sampling generator. Worker 0 draws the same random numbers as the
    sync trainer's engine (seeded with ``run.seed``), so sync and async runs of one seed
    draw from common random numbers (one group from the same weights is sampled alike; with
    several in flight the worker batches rows differently and the draws land elsewhere).
    With other seeds, one run of each compares two sampling streams, and at a few updates
    the stream decides more than the mode (SmolLM2, 8 steps of guess-number, the sync loop alone:
    26.6% held-out success with one stream, 71.9% with another)."""
    return run_seed if worker == 0 else run_seed * 1009 + 17 * worker


def vllm_engine(cfg: Config, policy: Any, index: int) -> Any:
    """A ``VLLMEngine`` for worker ``index`` on the GPU Ray gave it (not run here: no GPU).

    vLLM loads a model directory: a local one or the converted SmolLM2 cache as is; the tiny
    model, built in code, is first saved from ``policy`` to a temporary directory. The
    learner's weights then arrive through ``update_weights`` (vLLM's own loader, in place). The sampling seed is
    the worker's, as for the HF engine; vLLM draws other random numbers than it does.
    """
    from turnrl.rollout.vllm_engine import VLLMEngine

    path = policy.model_dir
    if path is None:  # the tiny model, built in code: saved for vLLM to load
        path = Path(tempfile.mkdtemp(prefix=f"turnrl-vllm-{index}-"))
        base_copy(policy.model).save_pretrained(path)  # LoRA: the adapter comes per version
        policy.tokenizer.save_pretrained(path)
    return VLLMEngine(path, seed=sampling_seed(cfg.run.seed, index), dtype=engine_dtype(cfg),
                      gpu_memory_utilization=cfg.ray.gpu_memory_utilization,
                      max_model_len=policy.max_context,
                      lora_config=vllm_lora_config(cfg.model.lora_plan()))


def ct2_engine(cfg: Config, model: torch.nn.Module, index: int) -> tuple[Any, Any]:
    """Worker ``index``'s ``CT2Engine`` (``ray.engine_dtype``, the worker's sampling seed and
    torch threads) and the ``BackgroundRefresh`` that converts each version sent to it."""
    from turnrl.rollout.ct2_engine import CT2Engine
    from turnrl.rollout.ct2_refresh import BackgroundRefresh

    engine = CT2Engine(model, compute_type=cfg.ray.engine_dtype,
                       seed=sampling_seed(cfg.run.seed, index))
    return engine, BackgroundRefresh(engine, cfg.rollout.temperature, fetched_state,
                                     name=f"ct2-refresh-{index}")


def fetched_state(sent: Any) -> dict[str, torch.Tensor]:
    """The state dict ``set_weights`` was sent: ``[ObjectRef]`` read from the object store
    (only when it is used), or a state dict; tied tensors restored."""
    if isinstance(sent, list):
        import ray

        sent = ray.get(sent[0])
    return with_tied_weights(sent)


TIED_KEYS = "__tied__"
"""Key of a published state dict that maps each dropped duplicate to the key it aliases."""


def without_tied_weights(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``state`` with tensors that share storage with an earlier one (a tied lm_head and
    embedding: a fifth of SmolLM2-135M) kept once, so each publication ships less."""
    kept: dict[str, Any] = {}
    first_key: dict[tuple[int, tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    for key, tensor in state.items():
        identity = (tensor.data_ptr(), tuple(tensor.shape))
        if identity in first_key:
            aliases[key] = first_key[identity]
        else:
            first_key[identity] = key
            kept[key] = tensor
    kept[TIED_KEYS] = aliases
    return kept


def with_tied_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inverse of ``without_tied_weights`` (a plain state dict passes through)."""
    state = dict(state)
    for key, original in state.pop(TIED_KEYS, {}).items():
        state[key] = state[original]
    return state


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
    runtime_env = uploaded(worker_runtime_env(cfg, [env_factory]))
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


def worker_needs(cfg: Config) -> dict[str, float]:
    """The resources one worker reserves, as ``ray status`` names them."""
    return {"CPU": cfg.ray.worker_cpus, "GPU": cfg.ray.worker_gpus,
            **{k: float(v) for k, v in cfg.ray.worker_resources.items()}}


def worker_pool_size(cfg: Config, outstanding_groups: int) -> int:
    """Episodes a worker keeps live: its share of the learner's outstanding groups."""
    share = math.ceil(outstanding_groups / cfg.ray.num_workers)
    return max(1, share) * cfg.rollout.group_size
