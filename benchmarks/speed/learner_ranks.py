"""The learner on 1 process vs N ranks (issue 52), side by side: ``turnrl train`` on the
default job (SmolLM2-135M) at ``--learner.world_size 1`` with all the cores vs ``N`` ranks
sharing them out (one thread each on a 2-core machine), in alternating rounds.

Per run: the medians over its steps (the first left out: start-up) of ``time/step_s``,
``time/update_s`` and ``time/publish_s`` (gathering FSDP shards into rank 0's sampler), and
the peak resident memory of each learner rank (VmHWM, polled). A model one process cannot hold
and N shards can: ``benchmarks/speed/learner_memory.py`` (a memory limit derived at run time).

Usage: ``python benchmarks/speed/learner_ranks.py [--ranks 2] [--strategy fsdp] [--steps 4]
[--rounds 2] [--model smollm2-135m-instruct]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).parent)]
import harness  # noqa: E402  (benchmarks/)
import learner_memory  # noqa: E402  (its runner: RLIMIT_AS, per-rank peaks from /proc)

STAGES = ("step", "update", "publish")


def train(args: argparse.Namespace, ranks: int, out: Path) -> dict:
    """One ``turnrl train`` run (learner_memory's runner, the default job's settings); its
    stage medians and per-rank peak memory (MB), or why it failed."""
    run = learner_memory.train(args.model, ranks, out, args.steps, strategy=args.strategy,
                               settings=(), malloc={})  # glibc's defaults: times as users run
    if run.code:
        return {"failed": run.last[:200]}
    rows = run.rows[1:] or run.rows  # the first step pays start-up
    figures = {stage: statistics.median(r.get(f"time/{stage}_s", 0.0) for r in rows)
               for stage in STAGES}
    figures["peak_mb"] = [run.rss_peak.get(r, 0) // 2**20 for r in range(ranks)]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp", choices=("ddp", "fsdp"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    load = harness.load_average()
    with tempfile.TemporaryDirectory(prefix="learner-ranks-") as scratch:  # runs' checkpoints
        work, count = Path(scratch), iter(range(10**6))
        variants = {f"world_size {n}": (lambda n=n: train(args, n, work / f"run{next(count)}"))
                    for n in (1, args.ranks)}
        rounds = harness.alternate(variants, args.rounds, warmup=0)
    print(f"{'variant':<14} {'step s':>8} {'update s':>9} {'publish s':>10}  peak MB per rank")
    medians = {}
    for name, results in rounds.results.items():
        ok = [r for r in results if "failed" not in r]
        for r in results:
            if "failed" in r:
                print(f"{name:<14} failed: {r['failed']}")
        if not ok:
            continue
        medians[name] = {s: statistics.median(r[s] for r in ok) for s in STAGES}
        peak = max(r["peak_mb"] for r in ok)
        print(f"{name:<14} {medians[name]['step']:>8.2f} {medians[name]['update']:>9.2f} "
              f"{medians[name]['publish']:>10.3f}  {peak}")
    print(harness.machine(load))
    one, many = medians.get("world_size 1"), medians.get(f"world_size {args.ranks}")
    value = harness.figure(many["update"] / one["update"]) if one and many else "n/a"
    print(harness.ratio_line(f"world_size {args.ranks} / 1 update seconds ({args.strategy})",
                             value))


if __name__ == "__main__":
    main()
