"""Time per policy version, publish to loaded, on CPUs: Ray's object store vs a gloo broadcast.

Each round publishes a new version (the learner's weights nudged) to idle rollout workers and
waits until every one has it loaded into its model (``RolloutWorker.load_newest``): once as
``ray.weight_sync object_store`` (``ray.put`` of the state, each worker fetches it), once as
``broadcast`` (the weight group, gloo on CPUs: flattened buckets over TCP), alternating which
goes first, in one process on one local Ray cluster of real ``RolloutWorker`` actors. Prints
each way's median, the ratio with its bootstrap interval over the rounds, the bytes one
version carries, the machine line and ``ratio: object_store / broadcast median = X`` (rounds,
intervals and report lines from the shared harness, ``benchmarks/harness.py``).

Usage: ``python benchmarks/speed/weight_sync.py [--model tiny|smollm2-135m-instruct] [--workers 2]
[--rounds 10]``
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

from turnrl.config import load_config
from turnrl.distributed.book import AssignmentBook
from turnrl.distributed.broadcaster import WeightBroadcaster
from turnrl.distributed.fleet import Fleet
from turnrl.distributed.workers import spawn_workers
from turnrl.policy import group_seed, load_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

WAYS = ("object_store", "broadcast")


def timed_versions(model_name: str, workers: int, rounds: int) -> tuple[dict, int]:
    """Seconds per version for each way (lists, one entry per round), and bytes per version."""
    import ray

    ray.init(address="local", num_cpus=max(2, workers), include_dashboard=False,
             log_to_driver=False)
    fleet = None
    try:
        cfg = load_config(None, ["--model.name", model_name, "--run.mode", "async",
                                 "--ray.num_workers", str(workers), "--ray.weight_sync",
                                 "broadcast", "--run.progress", "false"])
        model = load_policy(cfg).model
        broadcaster = WeightBroadcaster(cfg.ray.weight_sync_timeout_s)
        fleet = Fleet(spawn_workers(cfg, pool_size=1), AssignmentBook(partial(group_seed, cfg)),
                      broadcaster=broadcaster)
        fleet.publish(0, model)
        fleet.wait_started(timeout_s=900)  # the workers built their models; the group formed
        ray.get([h.load_newest.remote() for h in fleet.handles])
        version = 0
        seconds: dict[str, list[float]] = {way: [] for way in WAYS}
        first_parameter = next(model.parameters())

        def publish(way: str):
            def to_loaded() -> None:  # timed: publish until every worker has it loaded
                fleet.publish(version, model)
                loaded = ray.get([h.load_newest.remote() for h in fleet.handles])
                assert loaded == [version] * workers, (way, loaded, version)

            def run() -> None:
                nonlocal version
                version += 1
                with torch.no_grad():
                    first_parameter.add_(1e-3)  # a new version, as an update makes
                fleet.weights.broadcaster = broadcaster if way == "broadcast" else None
                seconds[way].append(harness.timed(to_loaded)[0])
            return run

        # object_store broadcast, broadcast object_store, ...: no way always goes first
        harness.alternate({way: publish(way) for way in WAYS}, rounds, warmup=0, flip=True)
        assert len(fleet.weights.broadcast_versions) == rounds  # every broadcast went through
        return seconds, fleet.weights.version_bytes
    finally:
        if fleet is not None:
            fleet.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    load = harness.load_average()
    seconds, size = timed_versions(args.model, args.workers, args.rounds)
    print(f"{args.model}: {size / 1e6:.2f} MB per version, {args.workers} workers, "
          f"{args.rounds} alternating rounds, publish until every worker has it loaded")
    for way in WAYS:
        least, most = harness.spread(seconds[way])
        print(f"  {way:<13} median {harness.percentile(seconds[way], 50) * 1e3:8.1f} ms "
              f"(min {least * 1e3:.1f}, max {most * 1e3:.1f})")
    print("  " + harness.interval_line("object_store / broadcast", seconds["object_store"],
                                       seconds["broadcast"]))
    print(harness.machine(load))
    print(harness.ratio_line("object_store / broadcast median",
                             harness.ratio_of_medians(seconds["object_store"],
                                                      seconds["broadcast"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
