"""Does an unmodified tinker-cookbook recipe train through ``turnrl tinker`` on CPU?

The recipe is ``tinker_cookbook.recipes.math_rl.train`` with ``env=arithmetic`` (the
cookbook's toy RL task: "What is X + Y?" for X, Y in 0..100 after one few-shot example,
reward = correct + 0.1 * (format - 1), format = the answer ended with the stop token within
``max_tokens``). It is the cookbook's smallest RL recipe that runs offline: its problems are
generated, where ``rl_basic.py`` and ``rl_loop.py`` download GSM8K from the hub.

tinker-cookbook 0.5.8 (the newest whose ``tml-renderers`` requirement the package index
meets) pins ``transformers<=5.5.4``, below the project's, so it is installed with
``--no-deps`` into its own directory (``--target``, default ``/tmp/cb``) and put on
PYTHONPATH for the recipe only; it imports and runs with the project's transformers.
The recipe runs as a subprocess with options on its own (chz) command line: the model is the
converted SmolLM2-135M-Instruct directory (the cookbook loads the tokenizer itself with
``AutoTokenizer``, so offline it needs a local directory, which the service also loads), and
the renderer is ``qwen3_instruct``, whose ChatML is SmolLM2's chat template token for token
(minus SmolLM2's default system prompt) with ``<|im_end|>`` as the stop token.

Usage: ``python benchmarks/learning/tinker_cookbook.py [--steps 15] [--lr 1e-3]`` or
``--analyse LOG_DIR`` for a finished run. Prints the recipe command, its wall time, the
per-step mean reward / correct / format, and the mean reward of the first and last ``--k``
steps with 95% intervals over problem groups (a group's episodes share a problem).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COOKBOOK = ["tinker-cookbook==0.5.8", "tml-renderers==0.2.1", "chz==0.4.0", "blobfile==3.3.0",
            "pyrage==1.4.0", "termcolor==3.3.0", "lxml==6.2.1", "pycryptodomex==3.24.2",
            # the math_rl recipe's extra (its module imports math grading even for arithmetic)
            "math-verify==0.9.0", "pylatexenc==2.11", "latex2sympy2_extended==1.11.0",
            "antlr4-python3-runtime==4.13.2"]


def setup_cookbook(target: Path) -> None:
    """Install the cookbook beside the project (not into its venv: it would downgrade
    transformers)."""
    if (target / "tinker_cookbook" / "recipes" / "math_rl" / "train.py").is_file():
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target",
                    str(target), *COOKBOOK], check=True)


def start_service(model_dir: str, threads: int, out_dir: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "turnrl", "tinker", "--model.name", model_dir,
                             "--serve.port", "0", "--run.threads", str(threads),
                             "--run.out_dir", out_dir], stdout=subprocess.PIPE, text=True,
                            env=env)
    return proc, re.search(r"http://[\d.]+:\d+", proc.stdout.readline()).group(0)


def recipe_command(url: str, model_dir: str, log_path: str, args: argparse.Namespace
                   ) -> list[str]:
    return [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train",
            f"model_name={model_dir}", "renderer_name=qwen3_instruct", "env=arithmetic",
            f"group_size={args.group}", f"groups_per_batch={args.groups}",
            f"max_tokens={args.max_tokens}", f"learning_rate={args.lr}", f"lora_rank={args.rank}",
            f"base_url={url}", f"log_path={log_path}", "behavior_if_log_dir_exists=delete",
            f"max_steps={args.steps}", "eval_every=0", "save_every=0"]


def group_means(log_dir: Path, key: str) -> list[list[float]]:
    """Per training step, each problem group's mean ``key`` ('reward', 'correct', 'format')
    over its episodes, read from the recipe's own rollout summaries."""
    steps = []
    for it in sorted(log_dir.glob("iteration_*")):
        if not (it / "train_rollout_summaries.jsonl").is_file():
            continue  # a step still running
        groups: dict[int, list[float]] = {}
        for line in (it / "train_rollout_summaries.jsonl").read_text().splitlines():
            row = json.loads(line)
            value = row["total_reward"] if key == "reward" else row["steps"][0]["metrics"][key]
            groups.setdefault(row["group_idx"], []).append(float(value))
        steps.append([statistics.fmean(v) for v in groups.values()])
    return steps


def interval(values: list[float]) -> str:
    """mean +- 1.96 standard errors (normal approximation)."""
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0
    return f"{mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]"


def report(log_dir: Path, k: int) -> None:
    for key in ("reward", "correct", "format"):
        steps = group_means(log_dir, key)
        print(f"{key} per step: " + " ".join(f"{statistics.fmean(s):.2f}" for s in steps))
        first = [g for s in steps[:k] for g in s]
        last = [g for s in steps[-k:] for g in s]
        print(f"{key}: first-{k} steps {interval(first)}  last-{k} steps {interval(last)}  "
              f"({len(first)} and {len(last)} problem groups)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--group", type=int, default=4, help="episodes per problem")
    parser.add_argument("--groups", type=int, default=4, help="problems per step")
    parser.add_argument("--max-tokens", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="the service's torch threads")
    parser.add_argument("--k", type=int, default=3, help="steps averaged at each end")
    parser.add_argument("--target", default="/tmp/cb", help="where the cookbook is installed")
    parser.add_argument("--analyse", help="only summarise this finished run's log dir")
    args = parser.parse_args()
    if args.analyse:
        report(Path(args.analyse), args.k)
        return
    import torch

    from turnrl.models import SMOLLM2, model_directory

    setup_cookbook(Path(args.target))
    model_dir = str(model_directory(SMOLLM2))
    print(f"machine: {platform.node()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}, "
          f"torch {torch.__version__}, model {model_dir}")
    work = Path(tempfile.mkdtemp(prefix="tinker-cookbook-"))
    proc, url = start_service(model_dir, args.threads, str(work / "service"))
    try:
        command = recipe_command(url, model_dir, str(work / "recipe"), args)
        print("recipe: PYTHONPATH=" + args.target + " TINKER_API_KEY=tml-local python "
              + " ".join(command[1:]), flush=True)
        env = {**os.environ, "PYTHONPATH": args.target, "TINKER_API_KEY": "tml-local"}
        began = time.perf_counter()
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        print(f"recipe wall time {time.perf_counter() - began:.0f} s, load "
              f"{os.getloadavg()[0]:.1f}")
        report(work / "recipe", args.k)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
