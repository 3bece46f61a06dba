"""What a rollout worker's generation costs per row, with and without weight updates. One process.

The async trainer's rollout worker runs the continuous turn loop (``TurnLoop``) over
a pool of live episodes whose tool calls take a log-normal latency. This runs that loop alone
(no learner, no Ray) on the tiny model for a fixed time, three ways, side by side:

- ``no swaps``: the weights never change, so every episode's keys/values are reused;
- ``swaps, re-read``: a new policy version every ``--swap-every`` seconds, as the learner
  publishes one; the engine drops every kept key/value and re-reads each live episode in full
  at its next turn (the default, exact: later tokens see only the new weights);
- ``swaps, kept``: the same swaps with ``keep_cache_across_versions`` (``--sampler.keep_kv_cache``:
  PipelineRL's in-flight update; later tokens attend to keys/values of older weights).

A version bump stands in for new weights (the cost is the same; the sampled text does not
matter here). The ways run in ``--rounds`` alternating rounds (the shared harness,
``benchmarks/harness.py``; 1 by default, each way once). Printed per way, medians over the
rounds: generated rows/s, rows per generate call, ms per row and the share of generate time
spent in prefill; then the machine line, and last
``ratio: swaps kept / swaps re-read rows per second = X``.

Usage: ``python benchmarks/speed/worker_loop.py [--median-ms 500] [--pool 320] [--seconds 20]
[--swap-every 1.8] [--rounds 1]`` (1.8 s is the tiny model's learner step at 500 ms in
``benchmarks/speed/async_throughput.py``; a 2-core machine, ~1 min a round).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

from turnrl.config import load_config
from turnrl.envs import make_env
from turnrl.models import configure_torch
from turnrl.policy import load_policy
from turnrl.rollout.loop import TurnLoop
from turnrl.samplers import SamplingParams
from turnrl.samplers import hf as hf_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def run_loop(policy, env: dict, pool: int, seconds: float, swap_every: float,
             keep: bool, own_threads: bool = False) -> dict[str, float]:
    """Play groups for ``seconds``; bump the engine's version every ``swap_every`` s (0: never).
    ``own_threads``: each env on a thread of its own, though the built-in envs are
    cooperative (they share one otherwise)."""
    engine = policy.engine
    engine.load(None, 0)  # a fresh cache for each way
    engine.keep_cache_across_versions = keep
    engine.max_kept_rows = max(engine.max_kept_rows, pool)
    last_swap = [time.perf_counter()]

    def maybe_swap() -> None:  # runs before each generate call, as a worker's weight load does
        if swap_every and time.perf_counter() - last_swap[0] >= swap_every:
            last_swap[0] = time.perf_counter()
            engine.load(None, engine.version + 1)

    params = SamplingParams(8, 1.0, 1.0, stop_token_ids=(policy.chat.end_of_turn,))

    def make():
        made = make_env("slow", **env)
        if own_threads:
            made.cooperative = False
        return made

    loop = TurnLoop(make, engine, policy.chat, params,
                             group_size=8, pool_size=pool, env_name="slow", max_turns=8,
                             before_generate=maybe_swap)
    for group in range(3000):  # more than a run plays: the pool stays full
        loop.submit(group, group)
    seconds_in = {"prefill": 0.0, "generate": 0.0}  # both counted for every call, even the last
    original = hf_engine._Batch.prefill, engine.generate

    def timed(stage, function):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds_in[stage] += time.perf_counter() - started
        return run

    hf_engine._Batch.prefill = timed("prefill", original[0])
    engine.generate = timed("generate", original[1])
    threading.Timer(seconds, loop.stop).start()
    started = time.perf_counter()
    try:
        asyncio.run(loop.run())
    finally:
        hf_engine._Batch.prefill = original[0]
        del engine.generate  # the class's method again
    wall = time.perf_counter() - started
    s = loop.stats
    return {"rows_per_s": s.generated_rows / wall,
            "rows_per_call": s.generated_rows / max(s.generate_calls, 1),
            "ms_per_row": 1000 * s.generate_s / max(s.generated_rows, 1),
            "prefill_share": seconds_in["prefill"] / max(seconds_in["generate"], 1e-9),
            "mean_live": s.live_at_calls / max(s.generate_calls, 1),
            "swaps": s.version_swaps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--median-ms", type=float, default=500.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--pool", type=int, default=320, help="live episodes")
    parser.add_argument("--seconds", type=float, default=20.0, help="per way")
    parser.add_argument("--swap-every", type=float, default=1.8)
    parser.add_argument("--threads", type=int, default=1, help="a worker's torch threads")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of the ways")
    args = parser.parse_args(argv)
    configure_torch(args.threads)
    env = {"env": "guess-number", "median_ms": args.median_ms, "sigma": args.sigma, "seed": 0}
    policy = load_policy(load_config(None, ["--model.name", "tiny"]))
    ways = {"no swaps": (0.0, False), "swaps, re-read": (args.swap_every, False),
            "swaps, kept": (args.swap_every, True)}
    load = harness.load_average()
    print(f"tiny model, {args.pool} live episodes, tools {args.median_ms:g} ms median "
          f"(sigma {args.sigma}), {args.threads} thread(s), {args.seconds:g} s per way, "
          f"{args.rounds} round(s)")
    runs = harness.alternate(
        {name: (lambda swap_every=swap_every, keep=keep: run_loop(
            policy, env, args.pool, args.seconds, swap_every, keep))
         for name, (swap_every, keep) in ways.items()}, args.rounds, warmup=0).results
    rates = {name: [r["rows_per_s"] for r in seen] for name, seen in runs.items()}
    for name, seen in runs.items():
        r = {key: statistics.median(x[key] for x in seen) for key in seen[0]}
        print(f"{name:<16} {r['rows_per_s']:6.0f} rows/s  {r['rows_per_call']:5.1f} rows/call  "
              f"{r['ms_per_row']:5.2f} ms/row  prefill {r['prefill_share']:4.0%}  "
              f"live {r['mean_live']:4.0f}  swaps {r['swaps']:g}", flush=True)
    print(harness.machine(load))
    print(harness.ratio_line("swaps kept / swaps re-read rows per second",
                             harness.ratio_of_medians(rates["swaps, kept"],
                                                      rates["swaps, re-read"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
