"""An async run (tiny, or ``--model``) on a local multi-node Ray cluster: 1 worker node vs 2.

``ray.cluster_utils.Cluster`` starts a head with no CPUs (the learner's node) and ``--nodes``
worker nodes of ``4 / nodes`` logical CPUs each (so both layouts reserve the same CPUs); two
rollout workers are spread over them (``ray.placement spread``). All nodes share this host's
cores, so the figures show what crossing nodes costs (object transfers, scheduling), not
what more machines would add. Printed as one JSON line: steady-state trained tokens/s (from the
end of step 1 to the end of the last; prompt and environment text included) and the weight
bytes pulled per node per step (``async/weights_mb_per_node``, ledger ``weights_bytes_by_node``),
and the shared harness's machine line (``benchmarks/harness.py``) as its ``machine`` field. One
layout a run, not a side-by-side timing: run it once per ``--nodes`` and compare the lines.
The job's config keys and its steady-state rate come from ``training_job.py``.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/speed/cluster_nodes.py --nodes 1
    PYTHONPATH=$PWD .venv/bin/python benchmarks/speed/cluster_nodes.py --nodes 2
    PYTHONPATH=$PWD .venv/bin/python benchmarks/speed/cluster_nodes.py --nodes 2 \
        --model smollm2-135m-instruct --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from training_job import job_keys, overrides, steady_rate  # benchmarks/speed/, this folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="tiny", help="e.g. smollm2-135m-instruct")
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    from turnrl.config import load_config
    from turnrl.launch import train_async
    from turnrl.metrics import read_metrics

    load = harness.load_average()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(args.nodes):
        cluster.add_node(num_cpus=4 // args.nodes)
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    scratch = Path(tempfile.mkdtemp(prefix="turnrl-cluster-nodes-"))
    run_dir = scratch / "run"  # removed at the end: a SmolLM2 run leaves 1.6 GB of checkpoints
    group_size, groups = 4, 4
    keys = job_keys(args.model, "arithmetic", group_size=group_size, groups_per_step=groups)
    keys.update({"run.mode": "async", "run.steps": args.steps, "ray.num_workers": 2,
                 "ray.placement": "spread", "run.out_dir": run_dir})
    cfg = load_config(None, overrides(keys))
    try:
        wall_s = harness.timed(lambda: train_async(cfg))[0]
        rows = read_metrics(run_dir / "metrics.jsonl")
        ledger = [json.loads(line)
                  for line in (run_dir / "assignments.jsonl").read_text().splitlines()]
    finally:
        cluster.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    nodes = sorted({node for line in ledger for node in line["weights_bytes_by_node"]})
    per_node_step = [sum(line["weights_bytes_by_node"].get(n, 0) for line in ledger) / len(ledger)
                     for n in nodes]
    print(json.dumps({
        "nodes": args.nodes, "steps": len(rows), "wall_s": round(wall_s, 1),
        "tokens_per_s": round(steady_rate(rows, "episode/tokens", group_size * groups), 1),
        "weights_mb_per_node_per_step": [round(b / 1e6, 3) for b in per_node_step],
        "worker_nodes": len(nodes), "machine": harness.machine(load)}))


if __name__ == "__main__":
    main()
