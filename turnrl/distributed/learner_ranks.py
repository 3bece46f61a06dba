"""Learner ranks as Ray actors (``--learner.launcher ray``): ranks 1..N-1 of a multi-rank
learner started on a Ray cluster, so the learner spans several machines without torchrun.

Rank 0 stays this (driver) process: it owns the run directory, the progress bar, metrics and
the rollout source, as with child processes (trainer/ranks.py). Each rank reserves one bundle
of a placement group (``learner.placement``: pack, spread, strict_*): ``ray.learner_cpus``
(at least 1) and ``ray.learner_gpus`` (-1: one GPU on CUDA, none on the CPU), the seat that
``LearnerSeat`` holds for a one-process learner. Bundle 0 is pinned to this process's node by
its node-id label and holds no process; bundles 1..N-1 carry the ``LearnerRank`` actors. The
rendezvous is the store rank 0 binds on its node address (``ray.util.get_node_ip_address``)
before the ranks join (``learner.port``, or a port the OS picks); the backend is chosen as
for local ranks (gloo on the CPU, NCCL on CUDA).

A cluster that cannot hold the bundles is refused in one line before any actor starts
(``missing_room``, from the nodes' totals), and again when the group is not placed within
``PLACE_WAIT_S`` (busy nodes); a placed actor may take ``ACTOR_START_S`` to start. A rank
actor that dies is noticed at rank 0's next collective (its sockets close; a hung one after
``learner.timeout_s``) and named by its rank and node.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from turnrl.config import Config, ConfigError, LearnerConfig
from turnrl.distributed.cluster import connect
from turnrl.distributed.placement import NODE_LABEL, PLACE_WAIT_S, STRATEGIES, free_resources
from turnrl.learner.world import RankLost, rendezvous_store
from turnrl.trainer.ranks import DEAD_WAIT_S, Started, device_for, serve_rank


def rank_bundle(cfg: Config, on_cuda: bool) -> dict[str, float]:
    """One rank's reservation: ``ray.learner_cpus`` (at least 1: a bundle cannot be empty)
    and ``ray.learner_gpus`` (-1: one GPU on CUDA, none on the CPU). On CUDA each rank needs
    a whole GPU of its own (NCCL does not share one between ranks)."""
    gpus = cfg.ray.learner_gpus if cfg.ray.learner_gpus >= 0 else float(on_cuda)
    if on_cuda and gpus != 1:
        raise ConfigError(f"learner.launcher ray on CUDA: every rank needs one whole GPU, and "
                          f"ray.learner_gpus is {gpus:g}; use --ray.learner_gpus 1 (or -1)")
    bundle = {"CPU": max(1.0, float(cfg.ray.learner_cpus)), "GPU": gpus}
    return {name: amount for name, amount in bundle.items() if amount > 0}


def holds(node: dict[str, float], bundle: dict[str, float]) -> int:
    """How many ``bundle``s fit in ``node``'s resources."""
    return min(math.floor(node.get(name, 0.0) / amount + 1e-9) for name, amount in bundle.items())


def missing_room(nodes: dict[str, dict[str, float]], home: str, bundle: dict[str, float],
                 count: int, placement: str) -> str:
    """Why ``count`` bundles (the first on node ``home``) cannot be placed with ``placement``
    on ``nodes`` (id -> total resources), even empty; '' when they can."""
    each = {node: holds(resources, bundle) for node, resources in nodes.items()}
    want = ", ".join(f"{name} {amount:g}" for name, amount in bundle.items())
    if each.get(home, 0) < 1:
        return f"rank 0's node (this process's) has no room for its bundle of {want}"
    if placement == "strict_pack" and each[home] < count:
        return (f"strict_pack puts all {count} bundles of {want} on rank 0's node, which "
                f"holds {each[home]}")
    if placement == "strict_spread":
        fit = sum(1 for n in each.values() if n > 0)
        if fit < count:
            return (f"strict_spread puts each of the {count} bundles of {want} on its own "
                    f"node, and {fit} of the cluster's {len(nodes)} nodes hold one")
    total = sum(each.values())
    if total < count:
        return f"{count} bundles of {want} are needed, and the whole cluster holds {total}"
    return ""


def cluster_nodes() -> dict[str, dict[str, float]]:
    """The live nodes' total resources, by node id."""
    import ray

    return {node["NodeID"]: node.get("Resources", {}) for node in ray.nodes() if node["Alive"]}


def check_room(cfg: Config, bundle: dict[str, float]) -> None:
    """Refuse, in one line and before any actor starts, a cluster that cannot hold the ranks."""
    import ray

    size, placement = cfg.learner.world_size, cfg.learner.placement
    why = missing_room(cluster_nodes(), ray.get_runtime_context().get_node_id(), bundle, size,
                       placement)
    if why:
        raise ConfigError(f"learner.world_size {size} as Ray actors (learner.placement "
                          f"{placement}): {why}; lower the world size, ray.learner_cpus or "
                          "ray.learner_gpus, loosen learner.placement, or add nodes "
                          "(`ray status`)")


def rank_group(cfg: Config, bundle: dict[str, float], wait_s: float = PLACE_WAIT_S):
    """The ranks' placement group, bundle 0 on this process's node, once Ray placed it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    size = cfg.learner.world_size
    home = {NODE_LABEL: ray.get_runtime_context().get_node_id()}
    group = placement_group([bundle] * size, strategy=STRATEGIES[cfg.learner.placement],
                            bundle_label_selector=[home] + [{}] * (size - 1))
    if not group.wait(timeout_seconds=wait_s):
        remove_placement_group(group)
        raise ConfigError(f"learner.world_size {size} as Ray actors: {size} bundles of "
                          f"{bundle} ({cfg.learner.placement}) were not free within {wait_s:g} s "
                          f"(free now: {free_resources(ray)}); wait for room or lower them")
    return group


class LearnerRank:
    """A learner rank > 0 in a Ray actor: joins rank 0's process group, then follows it."""

    def where(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def run(self, learner: dict, rank: int, size: int, address: str, port: int,
            threads: int) -> None:
        serve_rank(LearnerConfig(**learner), rank, size, address, port, threads, 0)


def rank_actors(cfg: Config, group: Any, bundle: dict[str, float]) -> list:
    """The ``LearnerRank`` actors 1..N-1, named ``turnrl-<pid>-learner-rank-<r>`` in
    namespace ``turnrl``, each in bundle r. Bundle 0 is rank 0's (the driver, which Ray does
    not count): placed, it holds the CPUs and GPU in Ray's books with no process in it."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def options(index: int, **more) -> dict:
        return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
                "max_restarts": 0, **more, "scheduling_strategy":
                PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}

    runtime_env = cfg.ray.runtime_env or None
    return [
        ray.remote(LearnerRank).options(**options(
            r, name=f"turnrl-{os.getpid()}-learner-rank-{r}", namespace="turnrl",
            runtime_env=runtime_env)).remote()
        for r in range(1, cfg.learner.world_size)]


ACTOR_START_S = 600.0
"""How long a placed rank actor may take to start: a Python that imports torch takes minutes
on a busy node (over 120 s seen at load 5 on two cores). Only a slow start waits this long:
Ray raises at once for an actor that cannot start (its runtime env, its process died)."""


def started_places(ranks: list, wait_s: float) -> list[str]:
    """``10.0.0.2, pid 7`` for each rank actor once it runs; one line if one never does
    within ``wait_s``."""
    import ray

    try:
        return [f"{ip}, pid {pid}" for ip, pid in ray.get(
            [actor.where.remote() for actor in ranks], timeout=wait_s)]
    except (ray.exceptions.RayError, TimeoutError) as err:
        text = (str(err).strip().splitlines() or [""])[0]
        raise RankLost(f"a learner rank's Ray actor did not start within {wait_s:g} s "
                       f"({type(err).__name__}: {text[:200]}); see `ray status` and the "
                       "actor's log (`ray logs`), then start the run again") from None


def dead_actors(runs: list, places: list[str], wait: bool) -> str:
    """``rank 1 (Ray actor on 10.0.0.2, pid 7: died ...) died`` for the ranks whose ``run``
    ended with an error (``wait``: up to ``DEAD_WAIT_S`` for the first)."""
    import ray

    ready, _ = ray.wait(runs, num_returns=1, timeout=DEAD_WAIT_S if wait else 0)
    if ready:  # one ended: give the others no extra time
        ready, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
    dead = []
    for rank, (ref, place) in enumerate(zip(runs, places, strict=True), start=1):
        if ref not in ready:
            continue
        try:
            ray.get(ref, timeout=0)
        except Exception as err:  # noqa: BLE001 - the actor's death, or what it raised
            text = (str(err).strip().splitlines() or [type(err).__name__])[0]
            dead.append(f"rank {rank} (Ray actor on {place}: {type(err).__name__}: "
                        f"{text[:200]})")
    return f"{', '.join(dead)} died" if dead else ""


@contextmanager
def ray_ranks(cfg: Config) -> Iterator[Started]:
    """Ranks 1..N-1 of ``cfg.learner.world_size`` as Ray actors (see the module docstring),
    stopped with their placement group when the block ends; a Ray cluster this started is
    shut down after."""
    import ray
    from ray.util.placement_group import remove_placement_group

    started_ray = connect(cfg)
    actors, group = [], None
    try:
        backend, device = device_for(cfg.learner, cfg.model.device, 0)
        bundle = rank_bundle(cfg, device.type == "cuda")
        check_room(cfg, bundle)
        group = rank_group(cfg, bundle)
        actors = rank_actors(cfg, group, bundle)
        places = started_places(actors, max(ACTOR_START_S, cfg.learner.timeout_s))
        print(f"learner ranks 1..{len(places)} as Ray actors: {'; '.join(places)}", flush=True)
        address = ray.util.get_node_ip_address()
        store = rendezvous_store(cfg.learner.world_size, cfg.learner.timeout_s, address,
                                 cfg.learner.port)
        threads = cfg.run.threads or int(bundle["CPU"])
        learner = {**asdict(cfg.learner), "backend": backend}
        size = cfg.learner.world_size
        runs = [actor.run.remote(learner, r, size, address, store.port, threads)
                for r, actor in enumerate(actors, start=1)]

        yield Started(address, store.port, threads,
                      lambda wait: dead_actors(runs, places, wait), lambda: stop(actors), store)
        # They return on rank 0's stop; a slow one is stopped below, the run's work is saved.
        ready, late = ray.wait(runs, num_returns=len(runs), timeout=cfg.learner.timeout_s)
        ray.get(ready)
        if late:
            print(f"learner ranks: {len(late)} rank actor(s) had not returned "
                  f"{cfg.learner.timeout_s:g} s after the run ended; stopping them", flush=True)
    finally:
        stop(actors)
        if group is not None:
            remove_placement_group(group)
        if started_ray:
            ray.shutdown()


def stop(actors: list) -> None:
    """Kill the rank actors (safe when they are gone)."""
    import ray

    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone, or the cluster is
            pass
