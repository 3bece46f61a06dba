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

Prints per-run lines, then medians per engine and the ct2/hf ratio, with the load average
before and after (``uptime``'s numbers)::

    python benchmarks/speed/ct2_async.py [--model tiny] [--steps 6] [--rounds 3] [--dtype int8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} ({os.cpu_count()} CPUs)"


def run_once(engine: str, args: argparse.Namespace, out: Path) -> dict:
    """One async run with ``engine`` workers; its steady-state figures."""
    command = [sys.executable, "-m", "turnrl.cli", "train", "--model.name", args.model,
               "--env.name", args.env, "--run.mode", "async", "--run.steps", str(args.steps),
               "--rollout.sampler", engine, "--eval.episodes", "0", "--run.checkpoint_every", "0",
               "--run.progress", "false", "--run.tensorboard", "false",
               "--rollout.group_size", str(args.group_size),
               "--rollout.groups_per_step", str(args.groups_per_step),
               "--rollout.max_new_tokens", str(args.max_new_tokens),
               "--run.seed", str(args.seed), "--run.out_dir", str(out)]
    if engine == "ct2":
        command += ["--rollout.sampler_dtype", args.dtype]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise SystemExit(f"{engine} run failed ({done.returncode}): {done.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return steady_state(records, args.group_size * args.groups_per_step)


def steady_state(records: list[dict], episodes_per_step: int) -> dict:
    """Rates from the end of the first step to the end of the last."""
    later = records[1:]
    seconds = records[-1]["time"] - records[0]["time"]
    tokens = sum(r["episode/tokens"] for r in later) * episodes_per_step
    policy = sum(r["episode/policy_tokens"] for r in later) * episodes_per_step
    figures = {"seconds": seconds, "tokens_per_s": tokens / seconds,
               "policy_tokens_per_s": policy / seconds,
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

    print(f"{args.model}, {args.env}, {args.steps} steps, {args.rounds} rounds; start: "
          f"{load_line()}", flush=True)
    runs: dict[str, list[dict]] = {"hf": [], "ct2": []}
    with tempfile.TemporaryDirectory(prefix="ct2-async-") as scratch:
        for round_ in range(args.rounds):
            order = ("hf", "ct2") if round_ % 2 == 0 else ("ct2", "hf")
            for engine in order:
                figures = run_once(engine, args, Path(scratch) / f"{engine}-{round_}")
                runs[engine].append(figures)
                print(f"round {round_ + 1} {engine:>3}: "
                      + ", ".join(f"{k} {v:.4g}" for k, v in figures.items())
                      + f" ({load_line()})", flush=True)
    medians = {engine: {key: statistics.median(f[key] for f in figures)
                        for key in figures[0]} for engine, figures in runs.items()}
    print(f"end: {load_line()}")
    print("| engine | trained tok/s | policy tok/s | worker rows/s | convert s | wait s "
          "| mismatch |")
    print("|---|---|---|---|---|---|---|")
    for engine, m in medians.items():
        name = f"ct2 {args.dtype}" if engine == "ct2" else "hf fp32"
        print(f"| {name} | {m['tokens_per_s']:.0f} | {m['policy_tokens_per_s']:.1f} | "
              f"{m['gen_rows_per_s']:.1f} | {m.get('convert_s', 0):.2f} | "
              f"{m.get('wait_s', 0):.4f} | {m['mismatch']:.3f} |")
    ratio = medians["ct2"]["tokens_per_s"] / medians["hf"]["tokens_per_s"]
    each = [c["tokens_per_s"] / h["tokens_per_s"] for h, c in zip(runs["hf"], runs["ct2"],
                                                                   strict=True)]
    print(f"ratio ct2/hf trained tokens/s: {ratio:.2f}x (per round: "
          + ", ".join(f"{r:.2f}" for r in each) + ")")


if __name__ == "__main__":
    main()
