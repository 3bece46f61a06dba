"""Learner ranks for the checkpoint tests: real gloo process groups on this machine, each rank
a spawned process running a list of operations (train and save, load and gather) in order.

Every operation that compares writes rank 0's gathered whole state (weights and AdamW moments
by parameter name) to a file, so the test process compares it with torch.equal. Importable by
the spawned children (multiprocessing hands them the parent's sys.path)."""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from turnrl.checkpoint import load_checkpoint, rng_state, save_checkpoint
from turnrl.config import LearnerConfig, OptimConfig
from turnrl.config.lora_plan import LoraSpec
from turnrl.learner.checkpoints import save_sharded
from turnrl.learner.shard import shard
from turnrl.learner.world import join, leave, rendezvous_store, store_client
from turnrl.lora import add_adapter, is_lora
from turnrl.models import tiny_model
from turnrl.trainer.step import make_optimizer

LORA = LoraSpec(r=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj"))
TIMEOUT_S = 60.0
"""Every collective's and every rank's limit: a broken rank fails the test, never hangs it."""


def build(world, strategy: str, lora: bool, seed: int):
    """The tiny model (LoRA on its seed-0 base: the base is the run's model, the adapter's A
    drawn from ``seed``; otherwise weights of ``seed``), split over ``world`` as ``strategy``
    says ('plain': left whole), and its AdamW."""
    model, _ = tiny_model(0 if lora else seed)
    if lora:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = add_adapter(model, LORA)
    if strategy != "plain":
        cfg = LearnerConfig(world_size=world.size, strategy=strategy)
        shard(model, dataclasses.replace(world, strategy=strategy), cfg)
        for module in model.modules():  # gloo has no PREMUL_SUM, which a divide factor of
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # 1 asks for otherwise
                module.set_force_sum_reduction_for_comms(True)
    return model, make_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.01))


def train(model, optimizer, steps: int = 2) -> None:
    """``steps`` AdamW updates on a fixed batch (the same on every rank)."""
    ids = torch.arange(24).reshape(2, 12) % 90 + 3
    for _ in range(steps):
        logits = model(ids).logits
        (logits.float().pow(2).mean() + logits[..., 5].mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def whole_state(model, optimizer) -> dict:
    """Weights and optimiser state, whole, by parameter name (every rank takes part)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=is_lora(model))
    weights, moments = get_state_dict(model, optimizer, options=options)
    return {"model": {k: v.detach().clone() for k, v in weights.items()},
            "optimizer": copy.deepcopy(moments)}


def _shared_path(path: str | None) -> str:
    """Rank 0's ``path`` on every rank."""
    message = [path]
    if dist.is_initialized():
        dist.broadcast_object_list(message, src=0)
    return message[0]


def train_save(world, strategy: str, lora: bool, run_dir: str, reference: str) -> None:
    """Train, write a TurnRL checkpoint (sharded when ``world``, else today's format), and
    keep the whole state it should load as in ``reference``."""
    model, optimizer = build(world, strategy, lora, seed=0)
    train(model, optimizer)
    if world is None:
        save_checkpoint(run_dir, 2, model, optimizer, rng=rng_state())
    elif world.leader:
        save_checkpoint(run_dir, 2, model, optimizer, rng=rng_state(),
                        weights=lambda tmp: save_sharded(_shared_path(str(tmp)), model,
                                                         optimizer))
    else:
        save_sharded(_shared_path(None), model, optimizer)
    state = whole_state(model, optimizer)
    if world is None or world.leader:
        torch.save(state, reference)


def load(world, strategy: str, lora: bool, checkpoint: str, out: str) -> None:
    """A fresh model of other weights (LoRA: another adapter draw) loads ``checkpoint`` on
    every rank; rank 0 writes the whole state it then holds to ``out``."""
    model, optimizer = build(world, strategy, lora, seed=7)
    load_checkpoint(checkpoint, model, optimizer)
    state = whole_state(model, optimizer)
    if world is None or world.leader:
        torch.save(state, out)


OPERATIONS = {"train_save": train_save, "load": load}


def rank_main(rank: int, size: int, port: int, operations: list, errors: str) -> None:
    """One spawned rank. It leaves as the real ranks do (turnrl.trainer.ranks): together,
    then without interpreter finalisation. A plain barrier and destroy, then a normal exit,
    let one rank tear its sockets down while a peer still read the barrier's last message,
    and finalisation may free what gloo's threads still hold: the peer aborts (SIGABRT),
    as a world-size-3 learner rank did in CI."""
    torch.set_num_threads(1)
    code = 0
    try:
        world = join(rank, size, "fsdp", "gloo", torch.device("cpu"), TIMEOUT_S,  # at the
                     "127.0.0.1", port, store_client("127.0.0.1", port, size, TIMEOUT_S))  # store
        for name, *args in operations:
            OPERATIONS[name](world, *args)
        leave(together=True)
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        leave()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(size: int, operations: list, errors: Path, timeout_s: float = 300.0) -> None:
    """``operations`` on ``size`` spawned ranks; an AssertionError with the ranks' tracebacks
    if any fails, or when they are not done within ``timeout_s`` (then they are killed)."""
    errors.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    store = rendezvous_store(size, TIMEOUT_S)  # bound before any rank starts: no port race
    ranks = [context.Process(target=rank_main, args=(r, size, store.port, operations,
                                                      str(errors)))
             for r in range(size)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
    late = [p for p in ranks if p.is_alive()]
    for process in late:
        process.kill()
        process.join(10)
    failed = sorted(errors.glob("rank*.txt"))
    report = "\n".join(f.read_text() for f in failed)
    assert not late, f"{len(late)} rank(s) still running after {timeout_s}s\n{report}"
    assert all(p.exitcode == 0 for p in ranks) and not failed, (
        f"exit codes {[p.exitcode for p in ranks]}\n{report}")
