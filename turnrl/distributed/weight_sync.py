"""Weights broadcast from the learner to the rollout workers (``ray.weight_sync: broadcast``).

The learner (rank 0) and every rollout worker it counts as up (ranks 1..N) form a
torch.distributed process group over a TCP store the learner hosts on a free port (address:
``ray.weight_sync_address``, else its node's IP in Ray). The group is a ``ProcessGroup`` object
of its own, not torch's default group, so it can be dropped and formed again in one process.

Backend: NCCL when the learner and every worker hold their weights on a CUDA GPU, each on its
own (NCCL takes one rank per GPU; two members on one GPU are refused in one line). A version
then goes GPU to GPU and stays on the worker's GPU: the HF engine copies it into its model, the
vLLM engine hands it to vLLM's worker process through CUDA IPC (``VLLMEngine.load``).
Otherwise gloo, through host memory (the CPU path the tests run).

A version is the published state (``published_state``: LoRA = the adapter alone, tied
duplicates dropped), cut into buckets of one dtype of at most ``BUCKET_BYTES``, each flattened
and broadcast as one tensor; the layout (names, shapes, offsets) travels with the Ray call that
tells each worker to receive. The worker keeps the received tensors as its newest version and
loads them before its next generate call, as it does a state dict from the object store.

Membership (the simpler of the two designs, re-forming rather than patching a group): formed
once the workers have started (``Fleet.wait_started``; the start version itself goes through
the object store while they build their models), and formed again at the next publish whenever
the up workers or an incarnation changed (a restart, a given-up or revived worker). A worker
that comes back between versions catches up through the object store. A broadcast that fails
(a member died mid-way) sends that version through the object store; the group re-forms at the
next publish. A group that cannot form within ``ray.weight_sync_timeout_s`` stops the run at
start with one line naming the fix; mid-run the run warns, sends that version through the
object store and tries again at the next publish, and after ``FORM_TRIES`` (publisher.py) failed
formations in a row uses the object store for the rest of the run.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

TIED_KEYS = "__tied__"
"""Key of a published state dict that maps each dropped duplicate to the key it aliases."""
BUCKET_BYTES = 64 << 20
"""Largest flattened bucket: few collectives per version, a bounded extra copy."""
PREFIX = "turnrl-weights"


class WeightGroupError(RuntimeError):
    """The weight group cannot form, or its members cannot share one backend."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor sits in its bucket."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: str
    """A torch dtype's name, e.g. 'float32' (a plain string crosses Ray as is)."""
    numel: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class Layout:
    """A version's tensors as buckets, plus the tied aliases (``without_tied_weights``)."""

    buckets: tuple[Bucket, ...]
    aliases: dict[str, str] = field(default_factory=dict)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_layout(state: dict[str, Any], bucket_bytes: int = BUCKET_BYTES) -> Layout:
    """Buckets of one dtype each, in ``state``'s order, closed once past ``bucket_bytes`` (a
    tensor larger than that has a bucket of its own)."""
    open_slots: dict[str, list[Slot]] = {}
    sizes: dict[str, int] = {}
    buckets: list[Bucket] = []
    for name, tensor in state.items():
        if not torch.is_tensor(tensor):
            continue
        dtype, numel = dtype_name(tensor.dtype), tensor.numel()
        slots = open_slots.setdefault(dtype, [])
        slots.append(Slot(name, tuple(tensor.shape), sizes.get(dtype, 0), numel))
        sizes[dtype] = sizes.get(dtype, 0) + numel
        if sizes[dtype] * tensor.element_size() >= bucket_bytes:
            buckets.append(Bucket(dtype, sizes.pop(dtype), tuple(open_slots.pop(dtype))))
    buckets += [Bucket(dtype, sizes[dtype], tuple(slots)) for dtype, slots in open_slots.items()]
    return Layout(tuple(buckets), dict(state.get(TIED_KEYS, {})))


def flatten(state: dict[str, Any], layout: Layout, device: torch.device) -> list[torch.Tensor]:
    """The learner's buckets: copies, so the next update cannot change what is in flight."""
    return [torch.cat([state[s.name].detach().reshape(-1) for s in bucket.slots]).to(device)
            for bucket in layout.buckets]


def unflatten(flats: list[torch.Tensor], layout: Layout) -> dict[str, Any]:
    """A published state (views into ``flats``) as ``without_tied_weights`` made it."""
    state: dict[str, Any] = {}
    for flat, bucket in zip(flats, layout.buckets, strict=True):
        for s in bucket.slots:
            state[s.name] = flat[s.offset:s.offset + s.numel].view(s.shape)
    state[TIED_KEYS] = dict(layout.aliases)
    return state


def weights_digest(state: dict[str, Any]) -> str:
    """SHA-256 of a state dict's tensors (names and bytes, any device): equal iff bit-equal."""
    digest = hashlib.sha256()
    for name in sorted(k for k, v in state.items() if torch.is_tensor(v)):
        tensor = state[name].detach().contiguous().reshape(-1)
        digest.update(f"{name}:{dtype_name(tensor.dtype)}:{tensor.numel()};".encode())
        digest.update(tensor.view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def device_identity(device: torch.device) -> tuple[str, str]:
    """('cuda', the GPU's UUID) or ('cpu', ''): what decides the backend."""
    if device.type != "cuda":
        return ("cpu", "")
    properties = torch.cuda.get_device_properties(device.index or 0)
    return ("cuda", str(getattr(properties, "uuid", device.index or 0)))


def choose_backend(learner: tuple[str, str], workers: dict[int, tuple[str, str]]) -> str:
    """'nccl' when every member holds CUDA weights on a GPU of its own, else 'gloo'; members
    sharing a GPU are refused (NCCL cannot, and gloo would hide a host round trip)."""
    if learner[0] != "cuda" or any(kind != "cuda" for kind, _ in workers.values()):
        return "gloo"
    owner = {learner[1]: "the learner"}
    for w, (_, gpu) in sorted(workers.items()):
        if gpu in owner:
            raise WeightGroupError(
                f"ray.weight_sync broadcast: worker {w} and {owner[gpu]} share GPU {gpu} (NCCL "
                "takes one member per GPU): give each worker a GPU of its own (--ray.worker_gpus "
                "1, --ray.learner_gpus 1) or use --ray.weight_sync object_store")
        owner[gpu] = f"worker {w}"
    return "nccl"


def new_group(store: Any, prefix: str, rank: int, world: int, backend: str,
              timeout_s: float) -> Any:
    """A process group of its own (not torch's default) over ``store``."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        # On a timeout, abort the communicator and raise in wait() instead of ending the
        # process (the default), so the learner can fall back to the object store.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def check_group(group: Any, device: torch.device, timeout_s: float) -> None:
    """One small broadcast, waited for with a bound: NCCL connects lazily, at the first one."""
    group.broadcast(torch.zeros(1, device=device), 0).wait(timedelta(seconds=timeout_s))


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


class WeightReceiver:
    """A worker's side: joins a group when the learner says so, receives versions."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.group: Any = None
        self.store: Any = None
        self.generation = 0

    def join(self, address: str, port: int, rank: int, world: int, backend: str,
             generation: int, timeout_s: float) -> str:
        """Join generation ``generation`` of the group; '' or the reason it failed."""
        import torch.distributed as dist

        self.close()
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.store = dist.TCPStore(address, port, world, False,
                                       timeout=timedelta(seconds=timeout_s))
            self.group = new_group(self.store, f"{PREFIX}-{generation}/", rank, world, backend,
                                   timeout_s)
            check_group(self.group, self.device, timeout_s)
        except Exception as err:  # noqa: BLE001 - the learner names it in its one line
            self.close()
            return first_line(err)
        self.generation = generation
        return ""

    def receive(self, generation: int, layout: Layout) -> dict[str, Any] | None:
        """The next version's tensors on this worker's device, or None without a group."""
        if self.group is None or generation != self.generation:
            return None
        try:
            flats = [torch.empty(b.numel, dtype=getattr(torch, b.dtype), device=self.device)
                     for b in layout.buckets]
            for flat in flats:
                self.group.broadcast(flat, 0).wait()
            if self.device.type == "cuda":  # the tensors are read on another stream/process
                torch.cuda.current_stream(self.device).synchronize()
        except Exception:  # noqa: BLE001 - a member died: the learner falls back and re-forms
            self.close()
            return None
        return unflatten(flats, layout)

    def close(self) -> None:
        close_group(self.group)
        self.group, self.store, self.generation = None, None, 0


def close_group(group: Any) -> None:
    """Drop a group; NCCL's communicators are aborted (a dead peer must not block exit)."""
    for name in ("abort", "shutdown"):
        method = getattr(group, name, None)
        if method is not None:
            try:
                method()
            except Exception:  # noqa: BLE001 - already broken
                pass
            return
