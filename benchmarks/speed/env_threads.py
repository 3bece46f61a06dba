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
import time

from worker_loop import run_loop

from turnrl.config import load_config
from turnrl.models import configure_torch
from turnrl.policy import load_policy


def pool_for(median_ms: float) -> int:
    """Live episodes: 64 keep a 0 ms worker busy; with slow tools most wait in them."""
    return 64 if median_ms == 0 else 240


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.0, 500.0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=15.0, help="per run")
    args = parser.parse_args(argv)
    configure_torch(1)
    policy = load_policy(load_config(None, ["--model.name", "tiny"]))
    ratio = float("nan")
    for median_ms in args.latencies:
        pool = pool_for(median_ms)
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for round_ in range(args.rounds):
            # Alternate which way goes first: a drift of the machine hits both alike.
            for own in (False, True) if round_ % 2 == 0 else (True, False):
                env = {"env": "guess-number", "median_ms": median_ms, "sigma": 1.0,
                       "seed": round_}
                cpu = time.process_time()
                r = run_loop(policy, env, pool, args.seconds, 0.75, True, own_threads=own)
                rows = r["rows_per_s"] * args.seconds
                # a busy machine may finish no row in a short window: no per-row figure then
                per_row = 1e3 * (time.process_time() - cpu) / rows if rows else float("nan")
                runs[own].append((r["rows_per_s"], per_row))
        medians = {own: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v))
                   for own, v in runs.items()}
        for own, (rows_s, cpu_ms) in medians.items():
            print(f"{median_ms:g} ms, pool {pool}, {'own threads' if own else 'shared':<11} "
                  f"{rows_s:6.0f} rows/s  {cpu_ms:5.2f} ms CPU a row  (median of "
                  f"{args.rounds}: {', '.join(f'{x:.0f}' for x, _ in runs[own])})", flush=True)
        ratio = medians[False][0] / medians[True][0] if medians[True][0] else float("nan")
        print(f"{median_ms:g} ms: shared / own threads rows per second = {ratio:.2f}")
    print(f"ratio: shared / own threads rows per second at {args.latencies[-1]:g} ms = "
          f"{ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
