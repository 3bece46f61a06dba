"""Learner ranks: starting them, and what ranks > 0 do.

``turnrl train --learner.world_size N`` makes this process rank 0 and starts ranks 1..N-1 as
child processes on this machine (``child_ranks``), or with ``--learner.launcher ray`` as Ray
actors placed on a cluster (distributed/learner_ranks.py); ``torchrun --nproc-per-node N -m
turnrl train ...`` starts them all itself (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are read).
At world size 1 with fsdp's own options (``LearnerConfig.ranked``) this process is the only
rank: a process group of one, so FSDP2 can shard (and offload, and cast) the model.
Rank 0 then runs the one learner loop (trainer/learn.py); every other rank runs ``follow``:
it builds its share of the learner from the config rank 0 sends, then does what rank 0 says
until told to stop: update on the step's episodes (``rl_step``, each on its share), gather the
weights to publish, write its part of a sharded checkpoint.

Rank 0 plays and scatters: sources (lock-step, Ray workers, a served endpoint) feed rank 0
alone, which sends each step's episodes to every rank (docs/learner.md says why).

A rank that dies is noticed at the next collective (its socket closes): the run stops with
one line naming it, and ``--resume`` continues from the last whole checkpoint. A rank that
hangs stops the run after ``learner.timeout_s``, named as the one that did not answer (a
stopped child by its state; of two ranks, the other one). A rank alive but stuck inside
FSDP's own forward or backward collectives, at three ranks or more, is not named: gloo's
error does not say which peer it waited for. Children die with rank 0 (PDEATHSIG), Ray
actors with its driver.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch

from turnrl.config import Config, ConfigError, LearnerConfig
from turnrl.learner.shard import fsdp_layers
from turnrl.learner.weights import published_pairs
from turnrl.learner.world import RankLost, World, join, leave, lost, rendezvous_store, store_client
from turnrl.models import model_skeleton
from turnrl.policy import policy_model
from turnrl.trainer.rl_step import StageTimer, rl_step
from turnrl.trainer.run import learner_for, restore_learner, seed_run

T = TypeVar("T")
DEAD_WAIT_S = 5.0
"""After a failed collective, how long a rank that died may take to be seen as ended."""
PEER_LOST_EXIT = 3
"""A child rank's exit code when another rank stopped answering: a consequence, not a cause,
so ``dead_ranks`` does not name it."""
LEARNER_ENV = "TURNRL_LEARNER"
"""The ``learner`` section, as JSON, for the ranks ``child_ranks`` starts."""


@dataclass
class Started:
    """Ranks 1..N-1 as a launcher started them: where rank 0 meets them, and how it names the
    ones that died (``dead``; ``wait``: give a dying rank a moment to be seen) and stops them."""

    address: str
    port: int
    threads: int
    """rank 0's torch threads"""
    dead: Callable[[bool], str]
    """``rank 1 (...) died``: the ranks that ended (or stopped) and took the run down, "" if
    none did"""
    kill: Callable[[], None]
    store: torch.distributed.Store
    """the ``rendezvous_store`` this process serves at ``port``, bound before any rank started;
    rank 0 joins through it, the launched ranks through a ``store_client``"""


Launcher = Callable[[Config], AbstractContextManager[Started]]


def follow(world: World) -> None:
    """Rank > 0: build this rank's share of the learner, then obey rank 0 until ``stop``."""
    name, payload = world.receive()
    if name == "stop":  # rank 0 failed before its run started
        return
    cfg, checkpoint, decoupled = payload
    seed_run(cfg)
    model, tokenizer = policy_model(cfg, world.device)
    learner = learner_for(cfg, model, tokenizer, decoupled=decoupled, world=world)
    if checkpoint is not None:
        restore_learner(checkpoint, learner)
    while True:
        name, payload = world.receive()
        if name == "update":
            rl_step(learner, payload, StageTimer())
        elif name == "gather":
            for _ in published_pairs(model):
                pass
        elif name == "save":
            from turnrl.learner.checkpoints import save_sharded

            save_sharded(payload, learner.model, learner.optimizer)
        elif name == "stop":
            return
        else:
            raise RuntimeError(f"learner rank {world.rank}: unknown command {name!r}")


def rank_threads(cfg: Config, world_size: int) -> int:
    """Torch threads per rank: ``run.threads``, or this machine's cores shared out."""
    return cfg.run.threads or max(1, (os.cpu_count() or 1) // world_size)


def device_for(cfg: LearnerConfig, model_device: str, local_rank: int) -> tuple[str, torch.device]:
    """(backend, device) of a rank: NCCL and the rank's own GPU on CUDA, gloo on the CPU.
    NCCL asked without CUDA is a one-line ``ConfigError``."""
    cuda = torch.cuda.is_available() and model_device in ("auto", "cuda")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ConfigError("learner.backend nccl needs CUDA GPUs, and this machine has none (or "
                          "model.device is cpu); use --learner.backend gloo (or auto)")
    return backend, torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")


def check_capacity(cfg: Config, world_size: int) -> None:
    """Refuse, in one line and before any rank starts, a world size this machine cannot
    hold: more ranks than GPUs on CUDA, more ranks than CPU cores on the CPU."""
    _, device = device_for(cfg.learner, cfg.model.device, 0)
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise ConfigError(f"learner.world_size {world_size}: this machine has "
                          f"{torch.cuda.device_count()} GPUs, one per rank is needed; lower it "
                          "or start ranks on several machines with torchrun")
    cores = os.cpu_count() or 1
    if device.type == "cpu" and world_size > cores:
        raise ConfigError(f"learner.world_size {world_size}: this machine has {cores} CPU "
                          f"cores, one per rank is needed; use --learner.world_size {cores} or "
                          "fewer")


def check_wrappable(cfg: Config) -> None:
    """Under fsdp, a model FSDP cannot wrap refused in one line before any rank starts: read
    from its module tree without weights (``models.model_skeleton``), as ``shard`` would find
    it (a LoRA adapter wraps the same layers)."""
    if cfg.learner.strategy != "fsdp":
        return
    m = cfg.model
    fsdp_layers(model_skeleton(m.name, cache_dir=m.cache_dir or None, revision=m.revision,
                               trust_remote_code=m.trust_remote_code))


def _die_with_parent() -> None:
    """In a child rank: receive SIGKILL when rank 0 dies (Linux), never outlive the run."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@contextmanager
def child_ranks(cfg: Config) -> Iterator[Started]:
    """Ranks 1..N-1 of ``cfg.learner.world_size`` as child processes of this one, stopped
    (killed after a grace period) when the block ends."""
    size = cfg.learner.world_size
    check_capacity(cfg, size)
    store = rendezvous_store(size, cfg.learner.timeout_s, "127.0.0.1", cfg.learner.port)
    learner = {**asdict(cfg.learner), "backend": device_for(cfg.learner, cfg.model.device, 0)[0]}
    env = {**os.environ, LEARNER_ENV: json.dumps(learner), "WORLD_SIZE": str(size),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    children = [subprocess.Popen([sys.executable, "-m", "turnrl.trainer.ranks"],
                                 env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                 preexec_fn=_die_with_parent if sys.platform == "linux" else None)
                for rank in range(1, size)]

    def kill() -> None:
        for child in children:
            child.kill()

    try:
        yield Started("127.0.0.1", store.port, rank_threads(cfg, size),
                      lambda wait: dead_ranks(children, DEAD_WAIT_S if wait else 0,
                                              cfg.learner.timeout_s), kill, store)
    finally:
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def dead_ranks(children: list[subprocess.Popen], wait_s: float = 0,
               timeout_s: float = 0) -> str:
    """``rank 1 (pid 7, signal SIGKILL) died`` for the children that have ended abnormally
    (one that saw another rank go, ``PEER_LOST_EXIT``, is not a cause), waiting up to
    ``wait_s`` for one to end (a dying process closes its sockets before it exits); when none
    has, the ones stopped by a signal (SIGSTOP, a debugger): alive, their sockets open, they
    never answer, so a collective waited ``timeout_s`` for them."""
    deadline = time.monotonic() + wait_s
    while children and all(child.poll() is None for child in children) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    dead, stopped = [], []
    for rank, child in enumerate(children, start=1):
        code = child.poll()
        if code not in (None, 0, PEER_LOST_EXIT):
            why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            dead.append(f"rank {rank} (pid {child.pid}, {why})")
        elif code is None and _stopped(child.pid):
            stopped.append(f"rank {rank} (pid {child.pid})")
    if dead:
        return f"{', '.join(dead)} died"
    if stopped and wait_s:
        return (f"{', '.join(stopped)} stopped by a signal (SIGSTOP or a debugger) and did "
                f"not answer within learner.timeout_s ({timeout_s:g} s)")
    return ""


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (Linux: state T or t in /proc; elsewhere False)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def run_as_rank0(cfg: Config, train: Callable[[], T], launcher: Launcher = child_ranks) -> T:
    """``train()`` as rank 0 of ``cfg.learner.world_size`` ranks that ``launcher`` starts (or
    that torchrun started: RANK is set). In a torchrun rank > 0, ``follow`` instead (returns
    None). A model fsdp cannot wrap is refused first, in one line (``check_wrappable``)."""
    check_wrappable(cfg)
    if "RANK" in os.environ:
        size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        backend, device = device_for(cfg.learner, cfg.model.device,
                                     int(os.environ.get("LOCAL_RANK", rank)))
        torch.set_num_threads(rank_threads(cfg, size))
        address, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
        world = join(rank, size, cfg.learner.strategy, backend, device, cfg.learner.timeout_s,
                     address, port)
        return _lead(lambda: world, train) if rank == 0 else _follow_then_leave(world)
    backend, device = device_for(cfg.learner, cfg.model.device, 0)
    with launcher(cfg) as ranks:  # refuses, in one line, a world it cannot hold
        torch.set_num_threads(ranks.threads)
        return _lead(lambda: join(0, cfg.learner.world_size, cfg.learner.strategy, backend,
                                  device, cfg.learner.timeout_s, ranks.address, ranks.port,
                                  ranks.store),
                     train, ranks)


def _lead(joined: Callable[[], World], train: Callable[[], T],
          ranks: Started | None = None) -> T:
    """Rank 0: join, ``train()``, then stop the other ranks. On an error the ranks a launcher
    started are killed first: they may sit in a collective rank 0 will never join (or never
    came to the rendezvous)."""
    try:
        world = joined()
        result = train()
    except BaseException as err:
        # before killing: the ones that died on their own (a failed collective: maybe one)
        dead = ranks.dead(isinstance(err, RuntimeError)) if ranks else ""
        if ranks:
            ranks.kill()
        leave()
        if dead:
            raise RankLost(f"learner {dead}; the run stopped: resume it with --resume "
                           "(the last checkpoint is whole)") from None
        raise
    try:
        world.command("stop")
    except BaseException:
        leave()
        raise
    leave(together=True)
    return result


def _follow_then_leave(world: World) -> None:
    try:
        follow(world)
    except BaseException:
        leave()
        raise
    leave(together=True)


def serve_rank(learner: LearnerConfig, rank: int, size: int, address: str, port: int,
               threads: int, local_rank: int) -> None:
    """A rank > 0 a launcher started: join rank 0 at ``address:port``, then follow it."""
    torch.set_num_threads(threads)
    backend, device = device_for(learner, "cuda" if learner.backend == "nccl" else "cpu",
                                 local_rank)
    world = join(rank, size, learner.strategy, backend, device, learner.timeout_s, address, port,
                 store_client(address, port, size, learner.timeout_s))
    _follow_then_leave(world)


def main() -> int:
    """A rank > 0 that ``child_ranks`` started."""
    learner = LearnerConfig(**json.loads(os.environ[LEARNER_ENV]))
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        serve_rank(learner, rank, size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                   max(1, (os.cpu_count() or 1) // size), int(os.environ.get("LOCAL_RANK", rank)))
    except RankLost as err:
        print(f"learner rank {rank}: {err}", file=sys.stderr)
        return PEER_LOST_EXIT
    except torch.distributed.DistError as err:  # inside FSDP's collectives: a peer went
        print(f"learner rank {rank}: {lost(err)}", file=sys.stderr)
        return PEER_LOST_EXIT
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalisation: objects gloo's threads still hold may be torn down there
    # in any order (pytorch#179291 describes a SIGABRT of that kind); the work is done.
    os._exit(code)
