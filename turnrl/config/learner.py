"""The ``learner`` section: how many processes train the policy, and how they share it.

World size 1 is the one-process learner every other section describes (its weights bit for
bit what they were before this section existed), unless fsdp's own options ask for FSDP2 on
one rank (``ranked``: mixed precision, CPU offload). Above 1, ``turnrl train`` starts that many
learner ranks on torch.distributed (docs/learner.md): rank 0 owns the run (the run directory,
the rollout source, the progress bar, metrics, checkpoints) and scatters each step's episodes;
every rank updates on its share, the gradients summed so the update is the one-process one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from turnrl.config.types import Section


@dataclass(frozen=True)
class LearnerConfig(Section):
    world_size: int = 1
    """learner processes (ranks). 1: this process alone (fsdp with param_dtype, reduce_dtype
    or cpu_offload set: FSDP2 on this one rank); N: turnrl train starts N ranks on this machine
    (torchrun's RANK/WORLD_SIZE are read instead when set)"""
    strategy: Literal["ddp", "fsdp"] = "fsdp"
    """world_size > 1: ddp keeps a whole copy of the weights and optimiser state on every
    rank and sums gradients; fsdp (FSDP2 fully_shard per decoder layer and on the root)
    keeps 1/N of each on every rank, gathering a layer's weights as it runs"""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: auto = nccl on CUDA, gloo on CPU"""
    param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """fsdp: the dtype weights are gathered and computed in (auto: the model's; the optimiser
    keeps them in the model's). Set at world size 1 too, it shards over that one rank"""
    reduce_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """fsdp: the dtype gradients are summed in across ranks (auto: the model's; set at world
    size 1 too, it shards over that one rank)"""
    cpu_offload: bool = False
    """fsdp on GPUs: keep the shards, gradients and optimiser state in CPU memory between
    uses (less GPU memory, slower steps); at world size 1 too (FSDP2 on one rank)"""
    timeout_s: float = 600.0
    """the longest any collective may wait for the other ranks before the run stops, naming
    the rank that did not answer (a dead rank is noticed at once)"""
    port: int = 0
    """the rendezvous port on rank 0's node for ranks turnrl train starts (0: a free one)"""
    launcher: Literal["local", "ray"] = "local"
    """who starts ranks 1..N-1: local = child processes on this machine; ray = Ray actors on
    the cluster at ray.address (else a local one), one placement-group bundle per rank of
    ray.learner_cpus (at least 1) and ray.learner_gpus (auto: 1 on CUDA); rank 0 stays this
    process either way; at world_size 1 there are no other ranks and it does nothing (so a
    run saved with launcher ray resumes at world size 1 unchanged) (docs/learner.md)"""
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"
    """launcher ray: how the ranks' bundles are placed (pack: on as few nodes as possible,
    spread: across nodes; strict_*: that or refused); rank 0's bundle is on its own node"""

    def ranked(self) -> bool:
        """Whether the learner runs as ranks on torch.distributed: above world size 1, or at 1
        with fsdp and one of its own options set (param_dtype, reduce_dtype, cpu_offload),
        which only FSDP2's ``fully_shard`` gives, even on one device. Otherwise world size 1
        is the one-process learner: fsdp is the default strategy, so it alone cannot mean
        "shard" without changing every run (and every saved config) at world size 1."""
        return self.world_size > 1 or (self.strategy == "fsdp" and (
            self.cpu_offload or self.param_dtype != "auto" or self.reduce_dtype != "auto"))

    def _check(self) -> None:
        self._at_least(1, "world_size")
        self._require("timeout_s", self.timeout_s > 0, "> 0")
        self._require("port", 0 <= self.port < 65536, "a port number (0: a free one)")
