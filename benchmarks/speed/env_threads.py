"""Cooperative envs on one shared env thread vs a thread each: a rollout worker's rows a second.

The turn loop runs every env on a thread and event loop of its own (so a blocking env blocks
only itself), except envs that declare ``cooperative = True`` (the built-in ones): those share
one. This runs a worker's turn loop alone (``worker_loop.run_loop``: tiny model, guess-number
behind ``slow``, weights swapped every 0.75 s with keys/values kept) both ways, alternating,
``--rounds`` times per latency, and prints the medians of rows/s and process CPU per row.

The last line reads ``ratio: shared / own threads rows per second at M ms = X`` for the last
latency. Usage: ``python benchmarks/speed/env_threads.py [--latencies 0 500] [--rounds 6]
[--seconds 15]`` (2 x rounds x seconds per latency, plus start-up).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Iterator
from itertools import count
from pathlib import Path

from worker_loop import run_loop  # benchmarks/speed/, this folder

from turnrl.config import load_config
from turnrl.models import configure_torch
from turnrl.policy import load_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def pool_for(median_ms: float) -> int:
    """Live episodes: 64 keep a 0 ms worker busy; with slow tools most wait in them."""
    return 64 if median_ms == 0 else 240


def one_run(policy, median_ms: float, seconds: float, own: bool, seeds: Iterator[int]
            ) -> Callable[[], float]:
    """One timed run of the worker loop (a new env seed each round): its rows a second."""
    def run() -> float:
        env = {"env": "guess-number", "median_ms": median_ms, "sigma": 1.0, "seed": next(seeds)}
        loop = run_loop(policy, env, pool_for(median_ms), seconds, 0.75, True, own_threads=own)
        return loop["rows_per_s"]
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.0, 500.0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=15.0, help="per run")
    args = parser.parse_args(argv)
    configure_torch(1)
    policy = load_policy(load_config(None, ["--model.name", "tiny"]))
    load, ratio = harness.load_average(), float("nan")
    for median_ms in args.latencies:
        # Alternating, which way goes first flipping each round: drift hits both alike.
        rounds = harness.alternate(
            {"shared": one_run(policy, median_ms, args.seconds, False, count()),
             "own threads": one_run(policy, median_ms, args.seconds, True, count())},
            args.rounds, warmup=0, flip=True)
        rates = rounds.results
        for name, rows_s in rates.items():
            # a busy machine may finish no row in a short window: no per-row figure then
            per_row = [1e3 * cpu / (rate * args.seconds) if rate else float("nan")
                       for cpu, rate in zip(rounds.cpu[name], rows_s, strict=True)]
            print(f"{median_ms:g} ms, pool {pool_for(median_ms)}, {name:<11} "
                  f"{statistics.median(rows_s):6.0f} rows/s  {statistics.median(per_row):5.2f} "
                  f"ms CPU a row  (median of {args.rounds}: "
                  f"{', '.join(f'{x:.0f}' for x in rows_s)})", flush=True)
        ratio = harness.ratio_of_medians(rates["shared"], rates["own threads"])
        print(f"{median_ms:g} ms: shared / own threads rows per second = {ratio:.2f}")
    print(harness.machine(load))
    print(harness.ratio_line(f"shared / own threads rows per second at "
                             f"{args.latencies[-1]:g} ms", ratio))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
