"""One extra setting next to the credit sweep: a critic (turn_gae, or token_gae with
``--method``) with the sweep's frozen settings plus ``--critic.features frozen`` (the critic reads a frozen copy of the starting policy),
at one horizon on the measurement seeds, scored against the sweep's threshold at that horizon.

Not part of the sweep's equal-budget protocol: the option was added after the tuning run.

Usage::

    python benchmarks/learning/credit_frozen_features.py --sweep DIR --out DIR2 [--horizon 16]
        [--method token_gae]

``--sweep``: the ``--out`` of a finished ``benchmarks/learning/credit_assignment.py`` run (its
summary.json gives the threshold and GRPO's figure to compare with).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import credit_assignment as bench  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--horizon", type=int, default=16)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--method", choices=("turn_gae", "token_gae"), default="turn_gae")
    args = p.parse_args()
    summary = json.loads((Path(args.sweep) / "summary.json").read_text())[str(args.horizon)]
    right_key, _ = bench.measure_right_key()
    s = bench.Settings(right_key=right_key)
    out = Path(args.out)
    knobs = bench.METHOD_SETTINGS[args.method] + ("--critic.features", "frozen")
    todo = [((args.horizon, args.method, "frozen", seed),
             bench.run_config_args(args.horizon, args.method, knobs, seed, s,
                                   str(out / "runs" / f"s{seed}")))
            for seed in range(args.seeds)]
    results_path = out / "results.json"
    out.mkdir(parents=True, exist_ok=True)
    previous = json.loads(results_path.read_text()) if results_path.exists() else {"runs": []}
    runs = sorted(bench.execute(out, todo, s, args.jobs, previous), key=lambda r: r["seed"])
    budget = s.steps * bench.episodes_per_step(s)
    reached = [min(bench.episodes_to(r, summary["threshold"]), budget) for r in runs]
    mean, lo, hi = bench.t_interval(reached)
    grpo = summary["methods"]["grpo"]
    print(f"horizon {args.horizon}, threshold {summary['threshold']:.1%}: {args.method} + frozen "
          f"critic features {mean:.0f} [{max(lo, 0):.0f}, {min(hi, budget):.0f}] episodes "
          f"(per seed {', '.join(f'{v:.0f}' for v in reached)}; critic used in "
          f"{[r['critic_in_use'] for r in runs]} of steps) vs grpo {grpo['mean']:.0f} "
          f"[{grpo['lo']:.0f}, {grpo['hi']:.0f}]: ratio {mean / grpo['mean']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
