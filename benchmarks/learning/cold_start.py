"""Cold start: tasks the base model (almost) never solves, learnt three ways, side by side.

RL from a policy that never succeeds gets no signal: every group's rewards are equal. This
compares, on tasks where base SmolLM2-135M scores <= 5% held-out:

- ``rl``: RL alone (GRPO), from the base model;
- ``warmup``: an SFT warm-up on the env's scripted reference player's demonstrations
  (``--sft.steps N --sft.env_demos M``, docs/sft.md), then the same RL;
- ``guided``: guided RL (``--explore.guidance demo``); printed "not available in this tree"
  where the config has no ``explore.guidance`` key.

Each run is one documented ``turnrl train`` command line (printed before it runs) in a
subprocess; its figures come from the run's ``eval_before.json`` / ``eval_after.json``
(``eval.episodes`` held-out seeds from ``eval.seed_offset``, disjoint from training seeds).
The table gives, per task and method: the base model's held-out success (the ``rl`` run's
``eval_before``, the untrained model), success when RL starts (after the warm-up), after RL
(median over seeds; 95% interval: Wilson for one seed, Student t over seed means for
several), and the median wall and CPU minutes of a whole run (warm-up, evaluations and RL
included). A task meets the goal when a method's median after-RL success is >= 50% with a
median wall time <= 20 minutes. Finished runs are reused (their ``eval_after.json`` exists),
so an interrupted benchmark continues where it stopped.

    python benchmarks/learning/cold_start.py                          # every task and method, 3 seeds
    python benchmarks/learning/cold_start.py --tasks frozenlake --methods rl,warmup --seeds 1
    python benchmarks/learning/cold_start.py --quick                  # tiny model, 1 step: a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from turnrl.stats import t_interval, wilson_interval

GOAL_SUCCESS, GOAL_WALL_MIN = 0.5, 20.0


@dataclass(frozen=True)
class ColdTask:
    env: tuple[str, ...]
    """``--env.*`` options naming the env and its constructor options"""
    max_turns: int
    max_new_tokens: int
    note: str


TASKS = {
    "basic-arithmetic": ColdTask(
        ("--env.name", "reasoning-gym", "--env.options.task", "basic_arithmetic"), 1, 32,
        "reasoning-gym basic_arithmetic (default difficulty), single turn"),
    "chain-sum": ColdTask(
        ("--env.name", "reasoning-gym", "--env.options.task", "chain_sum",
         "--env.options.min_terms", "2", "--env.options.max_terms", "2",
         "--env.options.min_digits", "1", "--env.options.max_digits", "1"), 1, 32,
        "reasoning-gym chain_sum, two one-digit terms (a + b or a - b), single turn"),
    "frozenlake": ColdTask(
        ("--env.name", "gymnasium", "--env.options.game", "FrozenLake-v1",
         "--env.options.is_slippery", "false"), 8, 8,
        "gymnasium FrozenLake 4x4, not slippery (one fixed map: 6 moves at best)"),
    "tool-arithmetic": ColdTask(
        ("--env.name", "tool-arithmetic"), 3, 48,
        "3-digit products with a calculator tool (README's tool task)"),
    "taxi": ColdTask(
        ("--env.name", "gymnasium", "--env.options.game", "Taxi-v4"), 20, 8,
        "gymnasium Taxi (about 12 moves at best)"),
}
METHODS = ("rl", "warmup", "guided")
DEFAULT_TASKS = ("chain-sum", "frozenlake", "tool-arithmetic")
"""the issue's three kinds (a reasoning-gym task, a gymnasium toy-text game, the README's tool
task); ``basic-arithmetic`` (no method learns it in 8 steps) and ``taxi`` run when named"""


@dataclass(frozen=True)
class Budget:
    model: str = "smollm2-135m-instruct"
    steps: int = 8
    group_size: int = 8
    groups_per_step: int = 4
    eval_episodes: int = 32
    sft_steps: int = 16
    sft_demos: int = 64
    threads: int = 2


QUICK = Budget(model="tiny", steps=1, group_size=2, groups_per_step=2, eval_episodes=4,
               sft_steps=1, sft_demos=4, threads=1)


def guidance_available() -> bool:
    """Whether this tree's config has ``explore.guidance`` (guided RL is merged)."""
    from turnrl.config.explore import ExploreConfig

    return any(f.name == "guidance" for f in dataclasses.fields(ExploreConfig))


def train_command(task: ColdTask, method: str, seed: int, budget: Budget,
                  out_dir: Path) -> list[str]:
    """The ``turnrl train`` command line of one run."""
    command = ["turnrl", "train", "--model.name", budget.model, *task.env,
               "--rollout.max_turns", str(task.max_turns),
               "--rollout.max_new_tokens", str(task.max_new_tokens),
               "--rollout.group_size", str(budget.group_size),
               "--rollout.groups_per_step", str(budget.groups_per_step),
               "--run.steps", str(budget.steps), "--run.seed", str(seed),
               "--run.threads", str(budget.threads), "--eval.episodes", str(budget.eval_episodes),
               "--run.progress", "false", "--run.tensorboard", "false",
               "--run.out_dir", str(out_dir)]
    if method == "warmup":
        command += ["--sft.steps", str(budget.sft_steps), "--sft.env_demos", str(budget.sft_demos)]
    elif method == "guided":
        command += ["--explore.guidance", "demo"]
    return command


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(command: list[str], out_dir: Path, keep_checkpoints: bool = False) -> dict:
    """Run one training (unless its results are there) and return its figures. A finished
    run's checkpoints are deleted unless ``keep_checkpoints``: its figures need only the
    evaluations, and SmolLM2's (weights and Adam moments, about 1.6 GB each, up to four for a
    warm-up run) would fill a disk over the 27 runs of the whole table."""
    record = out_dir / "cold_start.json"
    if record.exists() and (out_dir / "eval_after.json").exists():
        return json.loads(record.read_text())
    print("$ " + shlex.join(command), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    wall, cpu = time.perf_counter(), children_cpu_s()
    with open(out_dir / "train.log", "w") as log:
        done = subprocess.run([sys.executable, "-m", "turnrl.cli", *command[1:]], stdout=log,
                              stderr=subprocess.STDOUT, env=env)
    wall, cpu = time.perf_counter() - wall, children_cpu_s() - cpu
    if done.returncode != 0:
        tail = (out_dir / "train.log").read_text()[-1500:]
        raise SystemExit(f"cold_start: the run failed (exit {done.returncode}); "
                         f"its log {out_dir / 'train.log'} ends:\n{tail}")
    before = json.loads((out_dir / "eval_before.json").read_text())
    after = json.loads((out_dir / "eval_after.json").read_text())
    figures = {"command": shlex.join(command), "wall_s": wall, "cpu_s": cpu,
               "load": os.getloadavg()[0],
               "before": [before["successes"], before["episodes"]],
               "after": [after["successes"], after["episodes"]]}
    record.write_text(json.dumps(figures, indent=1))
    if not keep_checkpoints:
        for folder in (out_dir / "checkpoints", out_dir / "sft" / "checkpoints"):
            shutil.rmtree(folder, ignore_errors=True)
    return figures


def rate(pair: list[int]) -> float:
    return pair[0] / pair[1] if pair[1] else 0.0


def rate_cell(pairs: list[list[int]]) -> str:
    """Median success over seeds with its 95% interval (Wilson for one seed, else t)."""
    if len(pairs) == 1:
        lo, hi = wilson_interval(*pairs[0])
    else:
        _, lo, hi = t_interval([rate(p) for p in pairs])
    median = statistics.median(rate(p) for p in pairs)
    return f"{100 * median:.1f}% [{100 * max(lo, 0):.1f}, {100 * min(hi, 1):.1f}]"


def row(task: str, method: str, runs: list[dict], base: list[list[int]] | None) -> list[str]:
    base_cell = rate_cell(base) if base else "-"
    start = rate_cell([r["before"] for r in runs]) if method != "rl" else "= base"
    return [task, method, base_cell, start, rate_cell([r["after"] for r in runs]),
            str(len(runs)), f"{statistics.median(r['wall_s'] for r in runs) / 60:.1f}",
            f"{statistics.median(r['cpu_s'] for r in runs) / 60:.1f}"]


def meets_goal(runs: list[dict]) -> bool:
    return (statistics.median(rate(r["after"]) for r in runs) >= GOAL_SUCCESS
            and statistics.median(r["wall_s"] for r in runs) / 60 <= GOAL_WALL_MIN)


def print_rows(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                        help=f"comma-separated, from: {', '.join(TASKS)}")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, from: {', '.join(METHODS)}")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="RL steps per run (the budget)")
    parser.add_argument("--group-size", type=int, help="episodes per GRPO group")
    parser.add_argument("--groups-per-step", type=int, help="groups per RL step")
    parser.add_argument("--sft-steps", type=int, help="warm-up steps")
    parser.add_argument("--eval-episodes", type=int, help="held-out episodes before and after")
    parser.add_argument("--model", help="policy model (default SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, help="torch threads per run")
    parser.add_argument("--out", default="runs/cold_start")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each finished run's checkpoints (SmolLM2: 1.6 GB each)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 1 RL step, 4 held-out episodes: checks the wiring")
    args = parser.parse_args(argv)
    for name, known, chosen in (("task", TASKS, args.tasks), ("method", METHODS, args.methods)):
        unknown = [c for c in chosen.split(",") if c not in known]
        if unknown:
            parser.error(f"unknown {name} '{unknown[0]}'; choose from: {', '.join(known)}")
    return args


def budget_from(args: argparse.Namespace) -> Budget:
    budget = QUICK if args.quick else Budget()
    overrides = {"steps": args.steps, "sft_steps": args.sft_steps, "model": args.model,
                 "group_size": args.group_size, "groups_per_step": args.groups_per_step,
                 "eval_episodes": args.eval_episodes, "threads": args.threads}
    return dataclasses.replace(budget, **{k: v for k, v in overrides.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget, out = budget_from(args), Path(args.out)
    guided = guidance_available()
    print(f"# machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start; "
          f"budget {budget}", flush=True)
    rows, goals = [], {}
    for task_name in args.tasks.split(","):
        task, base = TASKS[task_name], None
        for method in args.methods.split(","):
            if method == "guided" and not guided:
                rows.append([task_name, method, "not available in this tree (no "
                             "explore.guidance)", "", "", "0", "", ""])
                continue
            runs = [run_once(train_command(task, method, seed, budget, folder), folder,
                             args.keep_checkpoints)
                    for seed in range(args.seeds)
                    for folder in [out / task_name / method / f"seed-{seed}"]]
            if method == "rl":
                base = [r["before"] for r in runs]
            rows.append(row(task_name, method, runs, base))
            goals.setdefault(task_name, []).append(method if meets_goal(runs) else None)
    print(f"\ncold start: {budget.model}, {budget.eval_episodes} held-out episodes per run, "
          f"{budget.steps} RL steps of {budget.group_size * budget.groups_per_step} episodes, "
          f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end")
    print_rows(["task", "method", "base", "RL start", "after RL (median)", "seeds", "wall min",
                "CPU min"], rows)
    for task_name, met in goals.items():
        winners = [m for m in met if m]
        print(f"goal (>= {GOAL_SUCCESS:.0%} held-out within {GOAL_WALL_MIN:g} wall min) "
              f"{task_name}: {'met by ' + ', '.join(winners) if winners else 'not met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
