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

SmolLM2-135M never adds two 2-digit numbers right (0 of 256 samples at temperature 1), so
with every answer wrong the recipe can only learn its format term. ``--warm-start N`` first
runs ``turnrl sft`` for N steps on generated sums (the recipe's own prompt shape, one
few-shot example; every pair the recipe's first 200 batches draw is left out, so the RL
problems are unseen) and exports the result (``turnrl export``) as the model the service and
the recipe load: a cold start from TurnRL, the recipe itself unchanged.

Usage: ``python benchmarks/learning/tinker_cookbook.py [--steps 15] [--lr 1e-3]
[--warm-start 200]`` or ``--analyse LOG_DIR`` for a finished run. Prints the recipe command, its wall time, the
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
import shutil
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


def batch_pairs(index: int, groups: int) -> list[tuple[int, int]]:
    """The (x, y) pairs of the arithmetic recipe's batch ``index``, its first ``groups``
    problems: the batch seeds ``numpy.random.RandomState(index)`` and draws
    ``randint(0, 101)`` twice a problem (tinker_cookbook/recipes/math_rl/arithmetic_env.py)."""
    import numpy as np

    rng = np.random.RandomState(index)
    return [(int(rng.randint(0, 101)), int(rng.randint(0, 101))) for _ in range(groups)]


def recipe_pairs(batches: int = 200, groups: int = 16) -> set[tuple[int, int]]:
    """Every pair of the recipe's first ``batches`` batches of up to ``groups`` problems."""
    return {pair for index in range(batches) for pair in batch_pairs(index, groups)}


def sum_demos(path: Path, rows: int, seed: int = 0) -> None:
    """``rows`` chat-format demonstrations "What is X + Y?" -> "X+Y" after the recipe's
    few-shot example (weight 0: context, not trained on), none of them a recipe pair."""
    import random

    held, rng = recipe_pairs(), random.Random(seed)
    with path.open("w") as f:
        written = 0
        while written < rows:
            x, y = rng.randint(0, 100), rng.randint(0, 100)
            if (x, y) in held:
                continue
            f.write(json.dumps({"messages": [
                {"role": "user", "content": "What is 4 + 5?"},
                {"role": "assistant", "content": "9", "weight": 0},
                {"role": "user", "content": f"What is {x} + {y}?"},
                {"role": "assistant", "content": str(x + y)}]}) + "\n")
            written += 1


def warm_start(model_dir: str, steps: int, work: Path) -> str:
    """``turnrl sft`` on generated sums, exported as a plain model directory."""
    sum_demos(work / "sums.jsonl", rows=16 * steps + 160)
    turnrl = [sys.executable, "-m", "turnrl"]
    began = time.perf_counter()
    subprocess.run([*turnrl, "sft", "--sft.data", str(work / "sums.jsonl"), "--model.name",
                    model_dir, "--run.steps", str(steps), "--sft.batch_size", "16",
                    "--optim.lr", "5e-5", "--sft.eval_fraction", "0.01",
                    "--run.checkpoint_every", str(steps), "--run.keep_checkpoints", "1",
                    "--run.progress", "false", "--run.out_dir", str(work / "sft")],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*turnrl, "export", str(work / "sft"), str(work / "warm")], check=True,
                   stdout=subprocess.DEVNULL)
    shutil.rmtree(work / "sft")  # 1.6 GB of checkpoint; the export is what is kept
    print(f"warm start: turnrl sft {steps} steps of 16 sums, lr 5e-5, "
          f"{time.perf_counter() - began:.0f} s with its export", flush=True)
    return str(work / "warm")


HELD_OUT_BATCHES = range(150, 182)
"""Batches whose first two problems are the held-out set: beyond any run's steps (the recipe
trains on batches 0..steps-1) and left out of the warm start's demonstrations."""


def held_out_problems(steps: int = 0, groups: int = 0) -> list[tuple[int, int]]:
    """The held-out problems, less any pair the run's own batches (``steps`` of ``groups``)
    happen to draw too: the batches are apart, the pairs only mostly (101 x 101 of them)."""
    trained = {pair for index in range(steps) for pair in batch_pairs(index, groups)}
    return [pair for index in HELD_OUT_BATCHES for pair in batch_pairs(index, 2)
            if pair not in trained]


def held_out_correct(url: str, model_dir: str, target: dict, cookbook: Path, samples: int,
                     problems: list[tuple[int, int]]) -> list[float]:
    """Each held-out problem's share of ``samples`` answers graded correct: the recipe's own
    env (``ArithmeticEnv`` with its few-shot prefix) builds the prompt and stop condition and
    grades each answer (its ``step``'s ``correct``); the real tinker client samples through
    the service at the recipe's temperature 1 and 5 tokens. ``target``:
    ``{"base_model": ...}`` or ``{"model_path": ...}``."""
    import asyncio

    if str(cookbook) not in sys.path:
        sys.path.insert(0, str(cookbook))
    import tinker
    from tinker import types
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    renderer = renderers.get_renderer("qwen3_instruct", get_tokenizer(model_dir))
    sampler = tinker.ServiceClient(base_url=url, api_key="tml-local").create_sampling_client(
        **target).result()

    def env(x: int, y: int) -> ArithmeticEnv:
        return ArithmeticEnv(x, y, renderer, convo_prefix=ArithmeticEnv.standard_fewshot_prefix())

    shares = []
    for x, y in problems:
        prompt, stop = asyncio.run(env(x, y).initial_observation())
        result = sampler.sample(prompt, samples, types.SamplingParams(
            max_tokens=5, temperature=1.0, stop=stop)).result()
        graded = [asyncio.run(env(x, y).step(seq.tokens)).metrics["correct"]
                  for seq in result.sequences]
        shares.append(statistics.fmean(float(c) for c in graded))
    return shares


def compare_held_out(before: list[float], after: list[float], samples: int) -> None:
    from turnrl.stats import sign_flip_test, t_interval

    differences = [b - a for a, b in zip(before, after, strict=True)]
    for name, shares in (("before RL", before), ("after RL", after)):
        mean, lo, hi = t_interval(shares)
        print(f"held-out {name}: {mean:.3f} [{lo:.3f}, {hi:.3f}] correct "
              f"({len(shares)} problems x {samples} samples)")
    mean, lo, hi = t_interval(differences)
    print(f"held-out gain: {mean:+.3f} [{lo:+.3f}, {hi:+.3f}] (t interval over problems), "
          f"paired sign-flip p = {sign_flip_test(differences):.3f}", flush=True)


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
    parser.add_argument("--warm-start", type=int, default=0, metavar="STEPS",
                        help="turnrl sft on generated sums first (0 = the base model)")
    parser.add_argument("--samples", type=int, default=4,
                        help="answers per held-out problem, before and after RL")
    parser.add_argument("--analyse", help="only summarise this finished run's log dir")
    args = parser.parse_args()
    if args.steps > HELD_OUT_BATCHES.start:
        parser.error(f"--steps at most {HELD_OUT_BATCHES.start}: later batches are held out")
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
    if args.warm_start:
        model_dir = warm_start(model_dir, args.warm_start, work)
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
        final = [json.loads(line) for line in
                 (work / "recipe" / "checkpoints.jsonl").read_text().splitlines()][-1]
        problems = held_out_problems(args.steps, args.groups)
        print(f"held-out: {len(problems)} problems ({len(held_out_problems()) - len(problems)} "
              "left out: the run's own batches drew them too)")
        before = held_out_correct(url, model_dir, {"base_model": model_dir},
                                  Path(args.target), args.samples, problems)
        after = held_out_correct(url, model_dir, {"model_path": final["sampler_path"]},
                                 Path(args.target), args.samples, problems)
        compare_held_out(before, after, args.samples)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
