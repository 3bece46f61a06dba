"""A dataset task the base model fails, learnt from its training rows: issue 54 item 6(a).

The task is a file a user could have: a JSONL of short addition questions in a few phrasings
("What is 14 + 7?", "Add 14 and 7.", ...) with integer answers, scored ``exact_match`` (the
reply must state its final answer: ``\\boxed{N}``, ``Answer: N`` or "the answer is N"; the
prompts do not say so). What must be learnt is in the training rows: the answer's form (no
prompt asks for it) and the sums. The held-out split is by operand pair: every row of a pair
(all its phrasings) is in the same split, chosen by a stable hash of the pair, so no held-out
question shares its numbers with a training row, let alone the row itself.

The runs are ``cold_start.py``'s (one ``turnrl train`` command line each, printed before it
runs; figures from the run's ``eval_before.json``/``eval_after.json``, the eval split only):
``rl`` (RL alone), ``warmup`` (SFT on the env's reference player's answers to training rows,
then RL at ``--rl-lr``, 4e-6: the default 4e-5 undid the warm-up) and ``guided``
(``--explore.guidance demo``). The table gives held-out success, base, at RL start and after
(95% intervals: Wilson for one seed, Student t over seeds for several) and the wall time.

    python benchmarks/learning/dataset_task.py                      # warmup and guided, 1 seed
    python benchmarks/learning/dataset_task.py --methods rl,warmup,guided --seeds 3
    python benchmarks/learning/dataset_task.py --write sums.jsonl   # only write the data file
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import statistics
import sys
from pathlib import Path

from turnrl.config.core import OptimConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cold_start  # noqa: E402

PHRASINGS = ("What is {a} + {b}?", "Add {a} and {b}.", "What do you get when you add {a} to {b}?",
             "Compute the sum of {a} and {b}.")
EVAL_FRACTION = 0.2
GOAL = 0.5


def eval_pair(a: int, b: int, fraction: float = EVAL_FRACTION) -> bool:
    """Whether the pair (a, b) is held out: a stable hash, the same on every machine."""
    digest = hashlib.blake2b(f"{a}+{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def sum_rows(first: range = range(1, 20), second: range = range(1, 10)) -> list[dict]:
    """Every (a, b) pair in every phrasing, in a fixed shuffled order, each row with its
    ``split`` (the dataset env's split column) decided by its pair."""
    rows = [{"prompt": phrasing.format(a=a, b=b), "answer": str(a + b),
             "split": "test" if eval_pair(a, b) else "train", "pair": f"{a}+{b}"}
            for a in first for b in second for phrasing in PHRASINGS]
    random.Random(0).shuffle(rows)  # eval seeds walk the file's order: mix pairs and phrasings
    return rows


def write_rows(path: Path) -> Path:
    """Write the data file, unless it is there already with the same rows (a run reading it
    from another process never sees it half-written)."""
    text = "".join(json.dumps(r) + "\n" for r in sum_rows())
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


def task_for(path: Path) -> cold_start.ColdTask:
    return cold_start.ColdTask(
        ("--env.name", "dataset", "--env.options.path", str(path),
         "--env.options.reward", "exact_match"), 1, 24,
        "additions a + b (a 1-19, b 1-9) in 4 phrasings, exact_match, split by operand pair")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="warmup,guided",
                        help=f"comma-separated, from: {', '.join(cold_start.METHODS)}")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="RL steps per run")
    parser.add_argument("--sft-steps", type=int, default=16, help="warm-up steps")
    parser.add_argument("--sft-demos", type=int, default=64, help="warm-up demonstrations")
    parser.add_argument("--rl-lr", type=float, default=4e-6,
                        help="warmup's RL learning rate (its SFT keeps optim.lr's default)")
    parser.add_argument("--eval-episodes", type=int, default=64)
    parser.add_argument("--model", default=cold_start.Budget.model)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/dataset_task")
    parser.add_argument("--write", metavar="FILE", help="write the data file and stop")
    parser.add_argument("--quick", action="store_true", help="tiny model: the wiring only")
    args = parser.parse_args(argv)
    unknown = [m for m in args.methods.split(",") if m not in cold_start.METHODS]
    if unknown:
        parser.error(f"unknown method '{unknown[0]}'; choose from: "
                     f"{', '.join(cold_start.METHODS)}")
    return args


def budget_from(args: argparse.Namespace) -> cold_start.Budget:
    if args.quick:
        return dataclasses.replace(cold_start.QUICK, eval_episodes=8)
    return cold_start.Budget(model=args.model, steps=args.steps, sft_steps=args.sft_steps,
                             sft_demos=args.sft_demos, eval_episodes=args.eval_episodes,
                             threads=args.threads)


def command(task: cold_start.ColdTask, method: str, seed: int, budget: cold_start.Budget,
            folder: Path, rl_lr: float) -> list[str]:
    """cold_start's command line; after a warm-up, RL at ``rl_lr`` (SFT at the default 4e-5):
    at 4e-5 one RL step took the warmed-up policy (entropy 0.03) from 91% to 31% training
    success, as cold_start.py saw on chain-sum (docs/datasets.md)."""
    line = cold_start.train_command(task, method, seed, budget, folder)
    if method == "warmup":
        line += ["--sft.lr", str(OptimConfig.lr), "--optim.lr", str(rl_lr)]
    return line


def reached(runs: list[dict]) -> bool:
    """The issue's goal: median held-out success after RL >= 50% (no time limit here; the
    wall time is reported beside it)."""
    return statistics.median(cold_start.rate(r["after"]) for r in runs) >= GOAL


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write:
        print(f"wrote {write_rows(Path(args.write))}")
        return 0
    budget, out = budget_from(args), Path(args.out)
    task = task_for(write_rows(out / "sums.jsonl"))
    print(f"# machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start; "
          f"budget {budget}", flush=True)
    table, base = [], None
    for method in args.methods.split(","):
        runs = [cold_start.run_once(command(task, method, seed, budget, folder, args.rl_lr), folder)
                for seed in range(args.seeds) for folder in [out / method / f"seed-{seed}"]]
        if method in ("rl", "guided"):  # their first evaluation is the untrained model's
            base = base or [r["before"] for r in runs]
        table.append((method, runs))
    print(f"\ndataset task ({task.note}): {budget.model}, {budget.eval_episodes} held-out "
          f"episodes per evaluation, {budget.steps} RL steps of "
          f"{budget.group_size * budget.groups_per_step} episodes; load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end")
    cold_start.print_rows(
        ["method", "base", "RL start", "after RL", "seeds", "wall min (mean)", ">= 50%"],
        [[method, cold_start.rate_cell(base) if base else "-",
          cold_start.rate_cell([r["before"] for r in runs]) if method == "warmup" else "= base",
          cold_start.rate_cell([r["after"] for r in runs]), str(len(runs)),
          f"{sum(r['wall_s'] for r in runs) / len(runs) / 60:.1f}",
          "met" if reached(runs) else "not met"] for method, runs in table])
    return 0


if __name__ == "__main__":
    sys.exit(main())
