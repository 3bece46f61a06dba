"""``turnrl eval --compare`` time per episode as the episodes grow (issue 58: 1024 tasks ran
44 min where 512 took 3.7): a cost growing faster than the episodes shows as a time per
episode that rises with them.

Trains a 1-step tiny-model run (the checkpoint B), then times ``turnrl eval --compare base
RUN --eval.episodes N`` for each N, in this process (the model load and the statistics
included; each N plays 2N episodes, one per policy). Also counts the Python calls of each
evaluation: a cost quadratic in pure Python shows there even on a noisy machine. Ends with
the shared harness's machine line and ``ratio: ms/episode at N_last / at N_first = X``
(``benchmarks/harness.py``; near 1 or below: no growth).

    PYTHONPATH=. python benchmarks/speed/eval_scaling.py --episodes 64 256 1024 2048
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import tempfile
from pathlib import Path

from turnrl.cli import main as turnrl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

COMMON = ["--model.name", "tiny", "--rollout.max_new_tokens", "3", "--run.progress", "false",
          "--run.tensorboard", "false"]


def timed_eval(run: Path, env: list[str], episodes: int, profile: bool) -> tuple[float, int]:
    """(seconds, Python calls or 0) of one ``turnrl eval --compare base RUN``."""
    argv = ["eval", "--compare", "base", str(run), *COMMON, *env,
            "--eval.episodes", str(episodes)]
    profiler = cProfile.Profile() if profile else None

    def evaluate() -> int:
        with contextlib.redirect_stdout(io.StringIO()):
            if profiler:
                profiler.enable()
            code = turnrl(argv)
            if profiler:
                profiler.disable()
        return code

    seconds, _, code = harness.timed(evaluate)
    if code != 0:
        raise SystemExit(f"turnrl eval exited {code}: {' '.join(argv)}")
    calls = sum(s[1] for s in pstats.Stats(profiler).stats.values()) if profiler else 0
    return seconds, calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, nargs="+", default=[64, 256, 1024, 2048])
    parser.add_argument("--env", default="arithmetic", help="a fast env (one turn)")
    parser.add_argument("--calls", action="store_true", help="also count Python calls "
                        "(cProfile: slower, so timed apart from the plain run)")
    args = parser.parse_args(argv)
    env = ["--env.name", args.env]
    load, per_episode = harness.load_average(), {}
    with tempfile.TemporaryDirectory(prefix="turnrl-eval-scaling-") as root:
        run = Path(root) / "run"
        with contextlib.redirect_stdout(io.StringIO()):
            turnrl(["train", *COMMON, *env, "--run.steps", "1", "--eval.episodes", "0",
                    "--run.out_dir", str(run)])
        timed_eval(run, env, 8, False)  # imports and first-call costs, not counted
        print(f"turnrl eval --compare base RUN, tiny model, env {args.env}")
        print("tasks  episodes  seconds  ms/episode" + ("  calls/episode" if args.calls else ""))
        for n in args.episodes:
            seconds, _ = timed_eval(run, env, n, False)
            per_episode[n] = seconds / (2 * n)
            line = f"{n:5d}  {2 * n:8d}  {seconds:7.1f}  {1000 * seconds / (2 * n):10.2f}"
            if args.calls:
                line += f"  {timed_eval(run, env, n, True)[1] / (2 * n):13.0f}"
            print(line, flush=True)
    print(harness.machine(load))
    first, last = args.episodes[0], args.episodes[-1]
    print(harness.ratio_line(f"ms/episode at {last} / at {first} tasks",
                             per_episode[last] / per_episode[first]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
