"""What the safety costs: env calls on their own thread, return checks, finite checks.

Side by side in one process, medians of repeated trials:
1. one env ``step`` awaited directly on the loop (the path before envs got threads) vs
   through its ``EnvRunner`` (own thread and event loop, timeout) plus ``checked_step``;
2. a whole collection of the default job's shape (guess-number, 32 episodes, up to 5
   turns, each env on its own thread as in (1), though guess-number is ``cooperative``) with
   the tiny model through ``run_episodes``, and the share the env-call overhead of (1) takes
   of it;
3. the non-finite check a checkpoint makes (``_require_finite``) on SmolLM2-135M's weights
   and fresh AdamW moments, next to writing that checkpoint.

(1) alternates direct and guarded trials (the shared harness, ``benchmarks/harness.py``,
which also gives the machine line and the ratio lines); (2) and (3) are timed alone.
Usage: ``python benchmarks/speed/safety_overhead.py [--calls 2000] [--skip-smollm2]``. The last line
is ``ratio: guarded / direct env call time = X``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from turnrl.envs import make_env
from turnrl.rollout.env_calls import EnvRunner, checked_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


async def _direct(env, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        await env.reset(0)
        await env.step("5")
    return (time.perf_counter() - started) / calls


async def _guarded(env, calls: int) -> float:
    runner = EnvRunner(env, "guess-number")
    try:
        started = time.perf_counter()
        for _ in range(calls):
            await runner.call("reset", 0, 30.0)
            checked_step(await runner.call("step", "5", 30.0), "guess-number")
        return (time.perf_counter() - started) / calls
    finally:
        runner.close()


def env_calls(calls: int, trials: int) -> tuple[list[float], list[float]]:
    """Seconds per (reset + step) pair, a trial each: direct, guarded (alternating, so
    drift hits both alike)."""
    rounds = harness.alternate(
        {"direct": lambda: asyncio.run(_direct(make_env("guess-number"), calls)),
         "guarded": lambda: asyncio.run(_guarded(make_env("guess-number"), calls))},
        trials, warmup=0)
    return rounds.results["direct"], rounds.results["guarded"]


def collection(trials: int) -> tuple[float, float]:
    """Median seconds of one 32-episode collection with the tiny model; mean env calls."""
    from turnrl.models import tiny_model
    from turnrl.rollout import ChatFormat, run_episodes, run_sync
    from turnrl.samplers import HFEngine, SamplingParams

    model, tok = tiny_model()
    chat = ChatFormat(tok)
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    params = SamplingParams(8, 1.0, 1.0, stop_token_ids=(chat.end_of_turn,))
    seeds = [(g, g) for g in range(4) for _ in range(8)]
    times, calls = [], []

    def own_thread_env():  # the path (1) measures: guess-number would share one otherwise
        env = make_env("guess-number")
        env.cooperative = False
        return env

    for _ in range(trials):
        took, _, episodes = harness.timed(lambda: run_sync(run_episodes(
            own_thread_env, seeds, engine, chat, params, env_name="guess-number", max_turns=5)))
        times.append(took)
        calls.append(sum(1 + len(ep.turns) for ep in episodes))
    return statistics.median(times), statistics.mean(calls)


def checkpoint_check() -> tuple[float, float]:
    """Seconds of the finite check and of the whole save, SmolLM2-135M + AdamW moments."""
    import torch

    from turnrl.checkpoint import _require_finite, rng_state, save_checkpoint
    from turnrl.config import OptimConfig
    from turnrl.models import load_model
    from turnrl.trainer.step import make_optimizer

    model, _ = load_model("smollm2-135m-instruct")
    optimizer = make_optimizer(model, OptimConfig())
    for p in model.parameters():  # give Adam its moments, as after a step
        p.grad = torch.zeros_like(p)
    optimizer.step()
    check_s = harness.timed(lambda: _require_finite(model, optimizer))[0]
    with tempfile.TemporaryDirectory() as tmp:
        save_s = harness.timed(lambda: save_checkpoint(tmp, 1, model, optimizer,
                                                       rng=rng_state()))[0]
    return check_s, save_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="env call pairs per trial")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--skip-smollm2", action="store_true")
    args = parser.parse_args(argv)
    load = harness.load_average()
    direct_trials, guarded_trials = env_calls(args.calls, args.trials)
    direct, guarded = statistics.median(direct_trials), statistics.median(guarded_trials)
    print(f"env reset+step pair: direct {direct * 1e6:.1f} us, guarded (own thread + "
          f"timeout + checks) {guarded * 1e6:.1f} us, overhead {(guarded - direct) * 1e6:.1f} us")
    step_s, calls = collection(max(3, args.trials // 2))
    overhead = (guarded - direct) / 2 * calls  # a pair is two calls
    print(f"collection, 32 guess-number episodes, tiny model: {step_s:.3f} s median, "
          f"{calls:.0f} env calls; their guard overhead {overhead * 1e3:.1f} ms "
          f"= {overhead / step_s:.1%} of the collection")
    if not args.skip_smollm2:
        check_s, save_s = checkpoint_check()
        print(f"checkpoint of SmolLM2-135M + AdamW: finite check {check_s:.3f} s of a "
              f"{save_s:.3f} s save ({check_s / save_s:.1%})")
    print(harness.interval_line("guarded / direct env call time", guarded_trials,
                                direct_trials))
    print(harness.machine(load))
    print(harness.ratio_line("guarded / direct env call time", guarded / direct))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
