"""The learner ranks of this run, and how rank 0 tells the others what to do.

Rank 0 runs the one learner loop (trainer/learn.py) with its source, progress bar, metrics
and run directory; the other ranks hold their share of the model and wait for commands
(``trainer/ranks.py``'s ``follow``). Before each collective step (an update, gathering the
weights to publish, a sharded checkpoint) rank 0 sends the command with its payload, so
every rank enters the same collectives in the same order.

A command's name travels through the rendezvous key-value store (rank 0 sets a numbered
key, which the others wait for as long as rank 0 may take between commands), its payload (a
step's episodes: megabytes of Python objects) on a gloo group of its own that waits
``learner.timeout_s``, so a run on NCCL never moves pickles through GPU memory. Not a
broadcast with a long timeout for the name: gloo's send waits for the receiver's recv, so a
rank that stopped answering (hung, or stopped by a signal) held rank 0 in that broadcast for
as long as the group waited (30 days), where setting a key never waits for a reader.
"""

from __future__ import annotations

import datetime
import json
import secrets
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from turnrl.config import ConfigError


class RankLost(RuntimeError):
    """Another rank stopped answering (died, or hung past ``learner.timeout_s``)."""


@dataclass
class World:
    """This process's place among the learner ranks."""

    rank: int
    size: int
    strategy: str
    """``ddp`` or ``fsdp`` (``learner.strategy``)."""
    device: torch.device
    timeout_s: float
    commands: Any = None
    """The store commands' names travel through (a key per command, this run's prefix)."""
    payloads: Any = None
    """The gloo process group commands' payloads travel on (waits ``timeout_s``)."""
    given: int = 0
    """Commands given (rank 0) or received (the others) so far: the next one's key."""

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def command(self, name: str, payload: Any = None) -> None:
        """Rank 0: tell every rank to do ``name`` (with ``payload``) next."""
        assert self.leader, "only rank 0 gives commands"
        self.given += 1
        try:
            self.commands.set(str(self.given), json.dumps([name, payload is not None]))
        except dist.DistError as err:  # a peer gone; an OOM stays itself
            raise lost(err, self) from None
        if payload is not None:
            self._broadcast([payload])

    def receive(self) -> tuple[str, Any]:
        """Ranks > 0: the next command and its payload."""
        self.given += 1
        try:
            self.commands.wait([str(self.given)], COMMAND_WAIT)
            name, has_payload = json.loads(self.commands.get(str(self.given)))
        except dist.DistError as err:
            raise lost(err, self) from None
        return name, self._broadcast([None])[0] if has_payload else None

    def _broadcast(self, message: list) -> list:
        try:
            dist.broadcast_object_list(message, src=0, group=self.payloads)
        except dist.DistError as err:
            raise lost(err, self) from None
        return message

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """``tensor`` reduced over the ranks, in place (on the tensor's own device)."""
        try:
            dist.all_reduce(tensor, op=op)
        except dist.DistError as err:
            raise lost(err, self) from None
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank, in place."""
        try:
            dist.broadcast(tensor, src=0)
        except dist.DistError as err:
            raise lost(err, self) from None
        return tensor


def lost(err: BaseException, world: World | None = None) -> RankLost:
    """A failed collective as one line: which rank went (of two ranks, the other one; gloo's
    error does not say which peer), and what to do."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    who = (f"learner rank {1 - world.rank}" if world is not None and world.size == 2
           else "a learner rank")
    return RankLost(f"{who} stopped answering ({text[:300]}); the run stopped: "
                    "resume it with --resume (the last checkpoint is whole)")


COMMAND_WAIT = datetime.timedelta(days=30)
"""How long ranks > 0 wait for rank 0's next command (it may evaluate or collect for
minutes). When rank 0 serves the store, its death closes the store's socket, which ends the
wait at once; under torchrun the agent serves it and ends the ranks itself."""
_CURRENT: list[World] = []
_SHARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rendezvous_store(size: int, timeout_s: float, address: str = "127.0.0.1",
                     port: int = 0) -> dist.TCPStore:
    """The store ``size`` ranks meet at, served by this process and listening before any rank
    starts (on every interface; ranks reach it at ``address``). Port 0 lets the OS pick one
    that stays bound: a port probed free, released and bound again later can be taken in
    between by another process. A given port in use is a one-line ``ConfigError``."""
    try:
        return dist.TCPStore(address, port, size, True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except dist.DistNetworkError as err:
        if "EADDRINUSE" not in str(err):
            raise
        raise ConfigError(f"learner.port {port} is in use on this machine; pick another, or "
                          "leave learner.port at 0 to let the OS choose a free one") from None


def store_client(address: str, port: int, size: int, timeout_s: float) -> dist.TCPStore:
    """A rank's connection to the ``rendezvous_store`` served at ``address:port``."""
    return dist.TCPStore(address, port, size, False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def join(rank: int, size: int, strategy: str, backend: str, device: torch.device,
         timeout_s: float, address: str, port: int, store: dist.Store | None = None) -> World:
    """Join the process group of ``size`` ranks at ``address:port`` as ``rank``: through
    ``store`` when given (every rank must then pass one: the rank serving it its
    ``rendezvous_store``, the others a ``store_client``; torch prefixes the keys of a store it
    makes itself, not of one it is given), else as torchrun's ranks do (``tcp://``, rank 0
    serving the store). Commands' names travel through the same store (a client of it under
    torchrun), under a prefix rank 0 draws for this run. NCCL (written for CUDA, never run on
    a GPU here) is joined as ``cpu:gloo,cuda:nccl``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":  # NCCL and FSDP's default mesh use the current device
        torch.cuda.set_device(device)
    if backend == "nccl":  # NCCL moves CUDA tensors only: the small CPU ones (micro-batch
        backend = "cpu:gloo,cuda:nccl"  # counts, metric sums) go over gloo in the same group
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank,
                                world_size=size, timeout=timeout)
    payloads = dist.new_group(backend="gloo", timeout=timeout)
    run = [secrets.token_hex(8) if rank == 0 else None]  # keys of this run alone (torchrun
    dist.broadcast_object_list(run, src=0, group=payloads)  # may restart on one store)
    keys = store if store is not None else store_client(address, port, size, timeout_s)
    commands = dist.PrefixStore(f"turnrl-commands/{run[0]}/", keys)
    world = World(rank, size, strategy, device, timeout_s, commands, payloads)
    _CURRENT[:] = [world]
    return world


def current() -> World | None:
    """The learner ranks this process belongs to (None: a one-process learner)."""
    return _CURRENT[0] if _CURRENT else None


def leave(together: bool = False) -> None:
    """Leave the process group (safe when never joined). ``together``: every rank leaves after
    ``stop``, so first wait for all of them (within ``timeout_s``): a rank that tore its
    sockets down while a peer still read the last message could abort that peer (SIGABRT,
    "terminate called without an active exception", seen once in CI at world size 3)."""
    if _CURRENT:
        world = _CURRENT.pop()
        if dist.is_initialized():
            if together:
                try:
                    dist.monitored_barrier(world.payloads,
                                           datetime.timedelta(seconds=world.timeout_s))
                except RuntimeError:
                    pass  # a peer already gone: nothing left to wait for
            dist.destroy_process_group()


def mark_sharded(model: torch.nn.Module, world: World) -> None:
    """Record that ``model`` is split over ``world`` (its weights move with collectives)."""
    _SHARDED[model] = world


def world_of(model: torch.nn.Module) -> World | None:
    """The ranks ``model`` is split over (None: a whole model in this process)."""
    return _SHARDED.get(model)


def gathered(state: dict[str, torch.Tensor], world: World) -> Iterator[tuple[str, torch.Tensor]]:
    """``state``'s tensors whole, one at a time (FSDP shards are all-gathered in turn, so no
    rank holds more than one whole tensor beyond its shards). Every rank iterates it in step;
    rank 0 first tells the others to (``gather``)."""
    from torch.distributed.tensor import DTensor

    if world.leader:
        world.command("gather")
    for name, tensor in state.items():
        try:
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        except dist.DistError as err:
            raise lost(err, world) from None
        yield name, whole.detach()
