"""Async training with HF vs CTranslate2 rollout workers (``--rollout.sampler hf`` / ``ct2``).

Each round runs the same async job twice, one run per engine, alternating (hf, ct2, hf,
ct2, ...) so that a drifting machine load hits both: ``turnrl train --run.mode async`` in its
own process with its own local Ray cluster (one worker on 1 CPU, the learner on the rest),
``--steps`` steps of ``--env`` with ``--model``. From each run's metrics.jsonl, over the
steady state (the end of step 1 to the end of the last step: start-up, the first version's
conversion and the pipeline fill are not in it):

- trained tokens/s: tokens (prompts and env text included) of the episodes the updates used,
  per second of wall time; and the policy tokens among them (what the workers sampled);
- the worker's generation rate (``rates/gen_rows_per_s``, rows a second while generating);
- ct2: each conversion's wall seconds (``async/refresh_convert_s``, done in the worker's
  background thread) and the seconds sampling waited on a refresh (``async/refresh_wait_s``,
  summed over the steady state: should be ~0), and the int8 mismatch
  (``mismatch/logprob_diff_mean``).

Prints per-run lines, then medians per engine and the ct2/hf ratio with its bootstrap interval
over the rounds, the machine line and ``ratio: ct2 / hf trained tokens per second = X``
(the alternation, intervals and report lines are the shared harness's,
``benchmarks/harness.py``; the job's config keys ``training_job.py``'s)::

    python benchmarks/speed/ct2_async.py [--model tiny] [--steps 6] [--rounds 3] [--dtype int8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from itertools import count
from pathlib import Path

from training_job import job_keys, overrides, steady_rate  # benchmarks/speed/, this folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run_once(engine: str, args: argparse.Namespace, out: Path) -> dict:
    """One async run with ``engine`` workers; its steady-state figures."""
    keys = job_keys(args.model, args.env, group_size=args.group_size,
                    groups_per_step=args.groups_per_step, max_new_tokens=args.max_new_tokens,
                    seed=args.seed)
    keys.update({"run.mode": "async", "run.steps": args.steps, "rollout.sampler": engine,
                 "run.out_dir": out})
    if engine == "ct2":
        keys["rollout.sampler_dtype"] = args.dtype
    harness.command([sys.executable, "-m", "turnrl.cli", "train", *overrides(keys)],
                    env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return steady_state(records, args.group_size * args.groups_per_step)


def steady_state(records: list[dict], episodes_per_step: int) -> dict:
    """Rates from the end of the first step to the end of the last."""
    later = records[1:]
    figures = {"seconds": records[-1]["time"] - records[0]["time"],
               "tokens_per_s": steady_rate(records, "episode/tokens", episodes_per_step),
               "policy_tokens_per_s": steady_rate(records, "episode/policy_tokens",
                                                  episodes_per_step),
               "gen_rows_per_s": statistics.median(
                   r["rates/gen_rows_per_s"] for r in later if r.get("rates/gen_rows_per_s")),
               "mismatch": statistics.mean(r["mismatch/logprob_diff_mean"] for r in later)}
    if "async/refresh_convert_s" in records[-1]:
        converts = [r["async/refresh_convert_s"] for r in later
                    if r.get("async/refresh_convert_s") is not None]
        figures["convert_s"] = statistics.median(converts) if converts else float("nan")
        figures["wait_s"] = sum(r["async/refresh_wait_s"] for r in later)
        figures["conversions"] = sum(r["async/refresh_conversions"] for r in later)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--env", default="guess-number")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="int8", help="rollout.sampler_dtype of the ct2 runs")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    load = harness.load_average()
    print(f"{args.model}, {args.env}, {args.steps} steps, {args.rounds} rounds; load at the "
          f"start {load:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ct2-async-") as scratch:
        def engine_run(engine: str) -> Callable[[], dict]:
            rounds = count(1)

            def run() -> dict:
                round_ = next(rounds)
                figures = run_once(engine, args, Path(scratch) / f"{engine}-{round_}")
                print(f"round {round_} {engine:>3}: "
                      + ", ".join(f"{k} {v:.4g}" for k, v in figures.items())
                      + f" (load {harness.load_average():.2f})", flush=True)
                return figures
            return run

        # hf ct2, ct2 hf, ...: no engine always runs first; no warm-up (each run is a process)
        runs = harness.alternate({"hf": engine_run("hf"), "ct2": engine_run("ct2")},
                                 args.rounds, warmup=0, flip=True).results
    medians = {engine: {key: statistics.median(f[key] for f in figures)
                        for key in figures[0]} for engine, figures in runs.items()}
    print("| engine | trained tok/s | policy tok/s | worker rows/s | convert s | wait s "
          "| mismatch |")
    print("|---|---|---|---|---|---|---|")
    for engine, m in medians.items():
        name = f"ct2 {args.dtype}" if engine == "ct2" else "hf fp32"
        print(f"| {name} | {m['tokens_per_s']:.0f} | {m['policy_tokens_per_s']:.1f} | "
              f"{m['gen_rows_per_s']:.1f} | {m.get('convert_s', 0):.2f} | "
              f"{m.get('wait_s', 0):.4f} | {m['mismatch']:.3f} |")
    rates = {engine: [f["tokens_per_s"] for f in figures] for engine, figures in runs.items()}
    each = harness.round_ratios(rates["ct2"], rates["hf"])
    print(harness.interval_line("ct2 / hf trained tokens/s", rates["ct2"], rates["hf"])
          + " (per round: " + ", ".join(f"{r:.2f}" for r in each) + ")")
    print(harness.machine(load))
    print(harness.ratio_line("ct2 / hf trained tokens per second",
                             harness.ratio_of_medians(rates["ct2"], rates["hf"])))


if __name__ == "__main__":
    main()
