"""Where the rollout workers and the learner sit on a Ray cluster (docs/cluster.md).

- Workers: each reserves ``ray.worker_cpus`` / ``worker_gpus`` plus ``ray.worker_resources``
  (custom resources) on a node carrying ``ray.worker_labels``; ``ray.placement`` other than
  ``default`` reserves one placement-group bundle per worker with that strategy (SPREAD, PACK,
  STRICT_*), and a restarted worker comes back in its own bundle.
- The learner is this (driver) process, which Ray does not count: ``LearnerSeat`` reserves
  ``ray.learner_cpus`` and its GPU on the learner's node with a one-bundle placement group, so
  no worker is placed on them, and the learner's torch threads follow its CPUs.

Pure helpers besides ``worker_group`` and ``LearnerSeat.take`` (which talk to Ray).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from turnrl.config import Config, ConfigError
from turnrl.distributed.cluster import cluster_address

STRATEGIES = {"spread": "SPREAD", "pack": "PACK", "strict_spread": "STRICT_SPREAD",
              "strict_pack": "STRICT_PACK"}
"""``ray.placement`` -> Ray's placement-group strategy."""
PLACE_WAIT_S = 120.0
"""How long the workers' placement group or the learner's seat may wait for room."""
NODE_LABEL = "ray.io/node-id"
"""The label Ray gives every node: pins the learner's bundle to the driver's node."""
log = logging.getLogger("turnrl.worker")


def worker_bundle(cfg: Config) -> dict[str, float]:
    """The resources one worker reserves, as ``ray status`` names them (zeros left out)."""
    bundle = {"CPU": float(cfg.ray.worker_cpus), "GPU": float(cfg.ray.worker_gpus)}
    bundle.update({name: float(amount) for name, amount in cfg.ray.worker_resources.items()})
    return {name: amount for name, amount in bundle.items() if amount > 0}


def worker_options(cfg: Config, group: Any = None, index: int = 0) -> dict[str, Any]:
    """Ray actor options placing worker ``index``: its resources, and its bundle of ``group``
    (the bundle carries the labels) or else a label selector."""
    options: dict[str, Any] = {"num_cpus": cfg.ray.worker_cpus, "num_gpus": cfg.ray.worker_gpus}
    if cfg.ray.worker_resources:
        options["resources"] = {k: float(v) for k, v in cfg.ray.worker_resources.items()}
    if group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=index)
    elif cfg.ray.worker_labels:
        options["label_selector"] = {k: str(v) for k, v in cfg.ray.worker_labels.items()}
    return options


def worker_group(cfg: Config, wait_s: float = PLACE_WAIT_S):
    """The placement group of ``ray.placement`` (one bundle per worker), once Ray has placed
    it; None for ``default``. One clear line when the cluster cannot hold it."""
    if cfg.ray.placement == "default":
        return None
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = worker_bundle(cfg)
    if not bundle:
        raise ConfigError(f"ray.placement {cfg.ray.placement} reserves a bundle per worker, "
                          "but a worker reserves nothing: set ray.worker_cpus above 0")
    count = cfg.ray.num_workers
    labels = [{k: str(v) for k, v in cfg.ray.worker_labels.items()}] * count
    group = placement_group([bundle] * count, strategy=STRATEGIES[cfg.ray.placement],
                            bundle_label_selector=labels if cfg.ray.worker_labels else None)
    if not group.wait(timeout_seconds=wait_s):
        remove_placement_group(group)
        on = f" on nodes labelled {cfg.ray.worker_labels}" if cfg.ray.worker_labels else ""
        raise RuntimeError(
            f"ray.placement {cfg.ray.placement}: {count} worker bundles of {bundle}{on} did "
            f"not fit the cluster within {wait_s:g} s (free now: {free_resources(ray)}); add "
            "nodes, lower ray.num_workers or the worker's resources, or use a looser "
            "placement (`ray status` shows the nodes)")
    return group


def bundle_placed(group: Any):
    """With a placement group, ``has_room(w)`` for a revived worker: its bundle is placed
    (Ray re-places a lost node's bundles when room returns; free CPUs do not show it). None
    without one (the fleet then looks at the cluster's free resources)."""
    if group is None:
        return None

    def has_room(w: int) -> bool:
        from ray.util.placement_group import placement_group_table

        try:
            return placement_group_table(group).get("state") == "CREATED"
        except Exception:  # noqa: BLE001 - the cluster is going
            return False

    return has_room


def free_resources(ray) -> str:
    """The cluster's free CPUs, GPUs and custom resources, short (no per-node ones)."""
    free = ray.available_resources()
    shown = {k: v for k, v in sorted(free.items())
             if not k.startswith(("node:", "memory", "object_store_memory", "bundle_group"))
             and "_group_" not in k}
    return ", ".join(f"{k} {v:g}" for k, v in shown.items()) or "nothing"


def auto_learner_gpus(on_cuda: bool, cluster_gpus: float, worker_gpus: float, workers: int,
                      node_free_gpus: float) -> float:
    """``ray.learner_gpus -1``: the share of one GPU the workers leave free in the cluster,
    at most what the learner's node has free; 0 when the learner is not on CUDA (a single
    GPU that workers reserve whole, as vLLM's default does, stays shared: nothing reserved)."""
    if not on_cuda:
        return 0.0
    spare = min(1.0, cluster_gpus - worker_gpus * workers, node_free_gpus)
    return round(spare, 4) if spare >= 0.01 else 0.0


def physical_gpu(index: int) -> str:
    """The id Ray gives CUDA device ``index`` of this process (under CUDA_VISIBLE_DEVICES)."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    return visible[index] if index < len(visible) else str(index)


class _Seat:
    """Started in the learner's bundle only to learn which GPUs Ray gave it."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


@dataclass
class LearnerSeat:
    """The learner's reservation on its own node (a one-bundle placement group pinned there)."""

    cpus: float
    gpus: float
    gpu_ids: list[str]
    group: Any = None

    @classmethod
    def take(cls, cfg: Config, on_cuda: bool, cuda_index: int = 0,
             wait_s: float = PLACE_WAIT_S) -> LearnerSeat:
        """Reserve ``ray.learner_cpus`` and the learner's GPU (``learner_gpus``, -1 = auto)
        on this process's node, before the workers are placed: within ``wait_s`` once there
        is room. Placing a bundle starts no process; only a GPU seat starts one, to learn the
        GPU's id, and it may take ``learner.timeout_s`` to start on a busy machine."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        node_id = ray.get_runtime_context().get_node_id()
        gpus = cfg.ray.learner_gpus
        if gpus < 0 and not on_cuda:
            gpus = 0.0
        elif gpus < 0:
            from turnrl.distributed.ray_internals import node_available

            node_free = node_available(node_id)
            gpus = auto_learner_gpus(on_cuda, ray.cluster_resources().get("GPU", 0.0),
                                     cfg.ray.worker_gpus, cfg.ray.num_workers,
                                     node_free.get("GPU", 0.0))
        cpus = cfg.ray.learner_cpus
        if cpus <= 0 and gpus <= 0:
            return cls(0.0, 0.0, [])
        bundle = {name: float(n) for name, n in (("CPU", cpus), ("GPU", gpus)) if n > 0}
        group = placement_group([bundle], bundle_label_selector=[{NODE_LABEL: node_id}])
        if not group.wait(timeout_seconds=wait_s):  # no room, or more than the node has
            remove_placement_group(group)
            from turnrl.distributed.cluster import node_label

            raise RuntimeError(
                f"the learner's reservation (ray.learner_cpus {cpus:g}, ray.learner_gpus "
                f"{gpus:g}) is not free on its node {node_label()} within {wait_s:g} s (free "
                f"in the cluster: {free_resources(ray)}); lower them, or run the learner on "
                "a node with room (`ray status`)")
        try:
            gpu_ids = _bundle_gpu_ids(group, gpus, max(wait_s, cfg.learner.timeout_s))
        except BaseException:
            remove_placement_group(group)
            raise
        if on_cuda and gpu_ids and physical_gpu(cuda_index) not in gpu_ids:
            log.warning("the learner trains on GPU %s but Ray reserved GPU %s for it: a "
                        "worker may share the learner's GPU; set CUDA_VISIBLE_DEVICES=%s for "
                        "the learner", physical_gpu(cuda_index), ",".join(gpu_ids),
                        gpu_ids[0])
        return cls(cpus, gpus, gpu_ids, group)

    def release(self) -> None:
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 - the cluster is already gone
                pass
            self.group = None


def _bundle_gpu_ids(group: Any, gpus: float, start_wait_s: float) -> list[str]:
    """The ids of the GPUs in ``group``'s bundle (none without GPUs): a ``_Seat`` started in
    it answers, then ends; the bundle keeps holding them."""
    if gpus <= 0:
        return []
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    seat = ray.remote(_Seat).options(
        num_cpus=0, num_gpus=gpus, max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote()
    try:
        return ray.get(seat.gpu_ids.remote(), timeout=start_wait_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"the learner's seat on its node did not start within "
                           f"{start_wait_s:g} s (its room is held: the machine may be too busy)"
                           "; raise learner.timeout_s") from None
    finally:
        ray.kill(seat)


def release_placement(seat: LearnerSeat | None, group: Any) -> None:
    """Give back the learner's seat and the workers' placement group (either may be None)."""
    if seat is not None:
        seat.release()
    if group is not None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(group)
        except Exception:  # noqa: BLE001 - the cluster is already gone
            pass


def learner_threads(cfg: Config) -> int:
    """Torch threads of the learner process.

    ``run.threads`` (0: every core this process may use), at most the learner's own CPUs in
    Ray (``ray.learner_cpus``) when it reserves some; else on a local cluster at most the
    cores the workers leave: each worker runs
    ``int(worker_cpus)`` threads, the learner gets what is left. On a 2-core laptop with one
    worker that is 1 thread each: 2 processes on 2 cores, where torch's default of one thread
    per core in every process would put 4 busy threads on 2 cores and thrash.
    """
    threads = cfg.run.threads or learner_cores()
    if cfg.ray.learner_cpus > 0:  # its own share in Ray's books; the workers have theirs
        return max(1, min(threads, int(cfg.ray.learner_cpus)))
    if cluster_address(cfg):  # the workers run elsewhere (or say so by their own reservations)
        return threads
    workers = cfg.ray.num_workers * max(1, int(cfg.ray.worker_cpus))
    return max(1, min(threads, (os.cpu_count() or 1) - workers))


def learner_cores() -> int:
    """The cores this process may run on (its affinity: a container's or a job's share)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
