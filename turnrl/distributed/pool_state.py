"""The async opponent pool (``opponent: pool``, ``run.mode: async``): what a worker is sent,
and how the pool is kept in checkpoints.

The learner of an async run holds no frozen copies of its pool: each member is a published
version whose state dict is in Ray's object store (``Fleet.pool``), and every worker builds
its own copy from there. A checkpoint saves the pool as the sync trainer does (turnrl/
trainer/local.py): the versions in ``state.json`` under ``opponent_pool``, each member's
weights under ``opponent_pool/vNNNNNN/`` (hard links to the previous checkpoint's or the
model's own files where they are the same). A member's model is built from the object store
only when its bytes are written: once per member for the whole run.

A resumed run reads the members back, puts each in the object store and hands the workers the
same pool before their first game. Each worker also resumes its count of games drawn (the
counter seeding each game's draw), so no resumed game replays a draw stream a trained game
used. Which game meets which member is not reproduced bit for bit: which worker plays which
group, and when, depends on timing (docs/selfplay.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from turnrl.checkpoint import load_frozen
from turnrl.distributed.worker_engines import with_tied_weights, without_tied_weights
from turnrl.lora import load_published, published_state
from turnrl.selfplay.pool import member_name
from turnrl.trainer.local import saved_pool


def pool_state(versions: list[int], draws: list[int]) -> dict:
    """The pool's entry in ``state.json``: its versions, the games each worker drew (and
    their total, which a sync resume of the same checkpoint reads as its own count)."""
    return {"versions": list(versions), "draws": sum(draws), "worker_draws": list(draws)}


def member_builder(model: torch.nn.Module, fetch: Callable[[], dict]) -> Callable:
    """A function building a frozen copy of ``model`` with the weights ``fetch()`` returns
    (a published state dict, tied tensors kept once): a checkpoint calls it only when it
    writes that member's bytes."""
    def build() -> torch.nn.Module:
        member = copy.deepcopy(model).requires_grad_(False)
        load_published(member, with_tied_weights(fetch()))
        return member
    return build


def member_states(checkpoint: Path, versions: list[int], model: torch.nn.Module
                  ) -> list[tuple[int, dict]]:
    """Each saved member's published state (tied tensors kept once), read into a scratch copy
    of ``model``; ``ValueError`` naming the version and the fix if a member's weights are
    missing."""
    scratch = copy.deepcopy(model).requires_grad_(False)
    states = []
    for version in versions:
        if not load_frozen(checkpoint, member_name(int(version)), scratch):
            raise ValueError(f"checkpoint {checkpoint}: opponent pool version {version} has no "
                             f"weights under {member_name(int(version))}/; move that "
                             "checkpoint aside to resume from the one before it")
        state = without_tied_weights(published_state(scratch))  # ties found before copying
        states.append((int(version), {k: v.to("cpu").clone() if torch.is_tensor(v) else v
                                      for k, v in state.items()}))
    return states


def frozen_members(versions: list[int], newest: int, model: torch.nn.Module,
                   refs: dict[int, object]) -> dict[str, torch.nn.Module | Callable]:
    """Each member's weights by checkpoint name: ``newest`` (the version just published) is
    ``model`` itself; an older one a builder reading its object-store copy in ``refs``."""
    import ray

    return {member_name(v): model if v == newest
            else member_builder(model, partial(ray.get, refs[v])) for v in versions}


def saved_members(run) -> tuple[list[tuple[int, dict]], dict[int, int]] | None:
    """The pool of the checkpoint ``run`` resumes from: each member's (version, published
    state) and each worker's games drawn; None for a fresh run or a checkpoint without a pool
    (one warning: the pool starts again from the resumed weights)."""
    saved = saved_pool(run)
    if saved is None:
        return None
    members = member_states(run.checkpoint, saved["versions"], run.learner.model)
    return members, worker_draws(saved)


def pool_message(members: list[tuple[int, object]], draws: int) -> list:
    """A worker's ``set_pool`` arguments: each member's ObjectRef in a list (so Ray hands the
    worker the reference, fetched only for a member it does not hold yet), and the games that
    worker's pool had drawn when one was reported (0: none, and the argument is left out)."""
    return [[(v, [r]) for v, r in members], *([draws] if draws else [])]


def seed_fleet(fleet, members: list[tuple[int, dict]], draws: dict[int, int]) -> list[int]:
    """The saved pool in ``fleet``: each member's weights put in the object store once and
    sent to every worker (before its first game) with the games that worker had drawn; the
    pool's versions."""
    import ray

    fleet.pool_draws.update({w: n for w, n in draws.items() if w < len(fleet.handles)})
    fleet.seed_pool([(version, ray.put(state)) for version, state in members])
    return [version for version, _ in members]


def worker_draws(saved: dict) -> dict[int, int]:
    """Games each worker had drawn when the checkpoint was written (none saved: {})."""
    return {w: int(n) for w, n in enumerate(saved.get("worker_draws") or []) if n}
