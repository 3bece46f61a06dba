"""Does an RL loop written against the real ``tinker`` client learn through ``turnrl tinker``?

A toy task, the client's loop as Tinker's docs write it: sample a group of completions from
the current sampler weights, reward each by the fraction of its tokens that are lowercase
letters, centre rewards within the group, train with the built-in ``importance_sampling``
loss on the sampler's own log-probs, ``optim_step``, save new sampler weights, repeat. The
service runs as its own process (``turnrl tinker --serve.port 0``).

Usage: ``python benchmarks/learning/tinker_rl.py [--model tiny] [--steps 20] [--seeds 0 1 2]``.
Prints, per seed, the mean reward of the first and last three steps, and last a ratio line:
``ratio: last-3 / first-3 mean reward, mean of S seeds = X``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import tinker
import torch
from tinker import types

warnings.filterwarnings("ignore", category=FutureWarning)


def start(model: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "turnrl", "tinker", "--model.name", model,
                             "--serve.port", "0", "--run.out_dir", tempfile.mkdtemp()],
                            stdout=subprocess.PIPE, text=True, env=env)
    return proc, re.search(r"http://[\d.]+:\d+", proc.stdout.readline()).group(0)


def run(url: str, model: str, steps: int, seed: int, group: int, lr: float) -> list[float]:
    service = tinker.ServiceClient(base_url=url, api_key="tml-local")
    client = service.create_lora_training_client(base_model=model, rank=8, seed=seed).result()
    tokenizer = client.get_tokenizer()
    prompt = tokenizer.encode("Write some words:")
    rewards = []
    for step in range(steps):
        sampler = client.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[],
                                      seed=seed * 1000 + step)
        seqs = sampler.sample(types.ModelInput.from_ints(prompt), group, params).result().sequences
        reward = [sum(tokenizer.decode([t]).islower() for t in s.tokens) / len(s.tokens)
                  for s in seqs]
        mean = statistics.fmean(reward)
        rewards.append(mean)
        data = []
        for s, r in zip(seqs, reward, strict=True):
            ids, n = prompt + list(s.tokens), len(prompt) - 1
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:],
                                "logprobs": [0.0] * n + list(s.logprobs),
                                "advantages": [0.0] * n + [r - mean] * len(s.tokens)}))
        client.forward_backward(data, "importance_sampling").result()
        client.optim_step(types.AdamParams(learning_rate=lr)).result()
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-3)
    args = parser.parse_args()
    print(f"machine: {platform.node()} {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"tinker {tinker.__version__}, model {args.model}")
    proc, url = start(args.model)
    try:
        ratios = []
        for seed in args.seeds:
            began = time.perf_counter()
            rewards = run(url, args.model, args.steps, seed, args.group, args.lr)
            first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
            ratios.append(last / max(first, 1e-9))
            print(f"seed {seed}: reward first-3 {first:.3f} last-3 {last:.3f} "
                  f"({time.perf_counter() - began:.0f} s) per step: "
                  + " ".join(f"{r:.2f}" for r in rewards), flush=True)
        print(f"ratio: last-3 / first-3 mean reward, mean of {len(ratios)} seeds = "
              f"{statistics.fmean(ratios):.2f}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
