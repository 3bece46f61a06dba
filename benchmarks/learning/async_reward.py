"""Does async training learn as much per trained episode as sync? Several seeds, paired.

One seed per mode cannot answer it: eight updates of SmolLM2 on guess-number depend on the
random stream about as much as on anything else (docs/benchmarks.md, async).
This runs the same ``turnrl train`` job for each seed in each mode, each its own process,
one after another on the same cores, and compares them seed by seed:

- ``sync``: the synchronous trainer;
- ``async``: ``--mode async`` with its defaults (pool, queue and staleness bound sized at
  run time from measured rates, ``pool.auto``; partial rollouts; keys/values kept
  across weight updates): what a user gets;
- ``async-onpolicy``: ``--mode async`` with staleness 0, stale groups regenerated, no partial
  rollouts, no over-provisioning: every trained token comes from the learner's current
  weights, so a gap here is the Ray path, not staleness.

Both modes train on the same number of episodes (``--steps`` x groups x group size), so the
mean training success over the run is the success per trained episode. The held-out success
after training (``eval.episodes`` seeds, no latency) is the other measure. A run whose
``eval_after.json`` exists is not run again, so an interrupted comparison continues.

Usage: ``python benchmarks/learning/async_reward.py --seeds 2 3 4 5 --out DIR`` (SmolLM2-135M, about
6 min a run on 2 cores); ``--model tiny --steps 4`` for a smoke check. The last line reads
``ratio: async / sync held-out success after N steps, mean of S seeds = X``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from turnrl.stats import mean_interval

MODE_FLAGS = {
    "sync": ["--run.mode", "sync"],
    "async": ["--run.mode", "async"],
    "async-onpolicy": ["--run.mode", "async", "--pool.auto", "false",
                       "--staleness.max_versions", "0",
                       "--staleness.on_stale", "regenerate", "--staleness.partial_rollouts",
                       "false", "--pool.overprovision", "1"],
}


def run_one(out: Path, mode: str, seed: int, args: argparse.Namespace) -> dict:
    """Train one (mode, seed) unless it already finished; its per-step and held-out success."""
    run_dir = out / f"{mode}-seed{seed}"
    after = run_dir / "eval_after.json"
    if not after.exists():
        command = [sys.executable, "-c", "from turnrl.cli import main; main()", "train",
                   *MODE_FLAGS[mode], "--model.name", args.model, "--run.seed", str(seed),
                   "--run.steps", str(args.steps), "--eval.episodes", str(args.eval_episodes),
                   "--run.out_dir", str(run_dir), "--run.progress", "false",
                   "--run.checkpoint_every", "0", *args.extra]
        started = time.perf_counter()
        with open(out / f"{mode}-seed{seed}.log", "w") as log:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
        if code != 0 or not after.exists():
            raise SystemExit(f"{mode} seed {seed} failed (exit {code}); see "
                             f"{out / f'{mode}-seed{seed}.log'}")
        print(f"{mode} seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    held_out = json.loads(after.read_text())
    before = json.loads((run_dir / "eval_before.json").read_text())
    return {"train_success": [s["success/rate"] for s in steps],
            "entropy": [s["entropy"] for s in steps],
            "after": held_out["successes"] / held_out["episodes"],
            "before": before["successes"] / before["episodes"]}


T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
"""Student's t 97.5% quantile by degrees of freedom: with a handful of seeds the normal
1.96 would make the interval far too narrow."""


def _interval(values: list[float]) -> str:
    mean, lo, hi = mean_interval(values, z=T_975.get(len(values) - 1, 1.96))
    return f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seeds", nargs="+", type=int, default=[2, 3, 4, 5])
    parser.add_argument("--modes", nargs="+", default=["sync", "async"],
                        choices=sorted(MODE_FLAGS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eval-episodes", type=int, default=64)
    parser.add_argument("--out", default="async_reward", help="run directories and logs")
    parser.add_argument("extra", nargs="*", help="more turnrl overrides, after --")
    args = parser.parse_args(argv)
    if args.modes[0] != "sync":
        parser.error("--modes must start with sync: the others are compared with it")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, dict]] = {mode: {} for mode in args.modes}
    for seed in args.seeds:  # seed by seed, so a cut-short comparison still has pairs
        for mode in args.modes:
            results[mode][seed] = run_one(out, mode, seed, args)
    (out / "results.json").write_text(json.dumps(results, indent=1))

    print(f"\n{args.model}, {args.steps} steps, seeds {args.seeds}: mean training success "
          "(per trained episode) and held-out success after; 95% t-intervals over seeds")
    print(f"{'mode':<16}{'per seed: train / held-out':<52}{'train':<24}{'held-out':<24}")
    for mode, by_seed in results.items():
        cells = " ".join(f"{sum(r['train_success']) / len(r['train_success']):.2f}/"
                         f"{r['after']:.2f}" for r in by_seed.values())
        train = [sum(r["train_success"]) / len(r["train_success"]) for r in by_seed.values()]
        after = [r["after"] for r in by_seed.values()]
        print(f"{mode:<16}{cells:<52}{_interval(train):<24}{_interval(after):<24}")
    sync = results["sync"]
    for mode in args.modes[1:]:
        train_diff = [sum(results[mode][s]["train_success"]) / args.steps
                      - sum(sync[s]["train_success"]) / args.steps for s in args.seeds]
        after_diff = [results[mode][s]["after"] - sync[s]["after"] for s in args.seeds]
        wins = sum(d > 0 for d in after_diff)
        print(f"{mode} - sync, paired: train {_interval(train_diff)}, held-out "
              f"{_interval(after_diff)}; {mode} ahead on held-out in {wins} of "
              f"{len(args.seeds)} seeds")
    mode = args.modes[-1]
    ratio = (sum(r["after"] for r in results[mode].values())
             / max(sum(r["after"] for r in sync.values()), 1e-9))
    print(f"ratio: {mode} / sync held-out success after {args.steps} steps, mean of "
          f"{len(args.seeds)} seeds = {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
