"""The learner on 1 process vs N ranks (issue 52), side by side: ``turnrl train`` on the
default job (SmolLM2-135M) at ``--learner.world_size 1`` with all the cores vs ``N`` ranks
sharing them out (one thread each on a 2-core machine), in alternating rounds.

Per run: the medians over its steps (the first left out: start-up) of ``time/step_s``,
``time/update_s`` and ``time/publish_s`` (gathering FSDP shards into rank 0's sampler), and
the peak resident memory of each learner process (VmHWM of the run's process tree, polled).
``--memory-limit-gb G`` caps every process's address space (RLIMIT_AS, inherited by the
ranks): a run that outgrows it fails, which is what shows a model that one process cannot
hold but N shards can (reported per variant, not raised).

Usage: ``python benchmarks/speed/learner_ranks.py [--ranks 2] [--strategy fsdp] [--steps 4]
[--rounds 2] [--model smollm2-135m-instruct] [--memory-limit-gb G]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

STAGES = ("step", "update", "publish")


def tree_peaks(root: int) -> dict[int, int]:
    """pid -> VmHWM (kB) of ``root`` and every descendant alive now."""
    peaks, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peaks[pid] = int(line.split()[1])
        todo += [int(c) for c in children]
    return peaks


def train(args: argparse.Namespace, ranks: int, out: Path) -> dict:
    """One ``turnrl train`` run; its stage medians and per-process peak memory (MB)."""
    cores = os.cpu_count() or 1
    argv = [sys.executable, "-m", "turnrl", "train", "--model.name", args.model,
            "--run.steps", str(args.steps), "--eval.episodes", "0", "--run.progress", "false",
            "--run.checkpoint_every", "0", "--run.out_dir", str(out),
            "--learner.world_size", str(ranks), "--learner.strategy", args.strategy,
            "--run.threads", str(max(1, cores // ranks))]
    limit = int(args.memory_limit_gb * 2**30) if args.memory_limit_gb else None

    def cap() -> None:
        if limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=cap)
    peaks: dict[int, int] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            for pid, kb in tree_peaks(proc.pid).items():
                peaks[pid] = max(peaks.get(pid, 0), kb)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, err = proc.communicate()
    done.set()
    watcher.join()
    if proc.returncode:
        last = (err.strip().splitlines() or ["(no stderr)"])[-1]
        return {"failed": last[:200]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = rows[1:] or rows  # the first step pays start-up
    figures = {stage: statistics.median(r.get(f"time/{stage}_s", 0.0) for r in rows)
               for stage in STAGES}
    figures["peak_mb"] = sorted(round(kb / 1024) for kb in peaks.values())[::-1][:ranks]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp", choices=("ddp", "fsdp"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--memory-limit-gb", type=float, default=0.0)
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
