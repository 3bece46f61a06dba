"""The built-in tool task learnt by the offline SmolLM2-135M-Instruct on CPU: before/after.

``tool-arithmetic`` asks for the product of two 3-digit numbers; the policy has a
``calculator`` tool. SmolLM2-135M cannot multiply those in its head, and from the prompt
alone it does not write a well-formed call either (its template has no tool support, so the
system prompt teaches the fallback ``<tool_call>`` format; measured: 0 of 32 episodes call
the tool correctly, also with a worked example in the prompt). So the run has two stages:

1. a *format* warm-up: a few supervised steps on scripted conversations of a different task
   (sums and differences with the same calculator and system prompt), tokenised exactly as
   the rollout loop tokenises episodes; it teaches the call syntax, not the product task;
2. RL (GRPO, ``turnrl.launch.train``) on ``tool-arithmetic`` from the warmed-up weights.

It prints one table: success with Wilson 95% intervals and the share of episodes that call
the tool correctly (a well-formed call whose result is the product) for the base model,
after the warm-up and after RL, each on the same held-out seeds; then sample conversations.

    python benchmarks/learning/tool_task.py                 # SmolLM2, ~10-15 min on 2 idle cores
    python benchmarks/learning/tool_task.py --steps 2 --episodes 8 --model tiny   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from turnrl.config import load_config
from turnrl.envs.tool_env import (
    Task,
    ToolEnv,
    calculator,
    multiplication_task,
    tool_arithmetic,
)
from turnrl.launch import train
from turnrl.metrics import print_table
from turnrl.models import configure_torch, load_model
from turnrl.policy import load_policy
from turnrl.rewards import integer_match
from turnrl.rollout import ChatFormat
from turnrl.stats import format_rate
from turnrl.trainer.evaluation import held_out_eval
from turnrl.types import Episode, read_episodes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from warmup import encode_demonstration, imitation_steps  # noqa: E402

ENV = "tool-arithmetic"


def sum_or_difference(seed: int) -> Task:
    """The warm-up's task: not the product task RL is measured on."""
    rng = random.Random(seed)
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    if rng.random() < 0.5:
        return Task(f"What is {a} plus {b}?", a + b, {"expression": f"{a} + {b}"})
    return Task(f"What is {a} minus {b}?", a - b, {"expression": f"{a} - {b}"})


def call_text(expression: str) -> str:
    return ("<tool_call>\n" + json.dumps({"name": "calculator",
                                          "arguments": {"expression": expression}})
            + "\n</tool_call>")


async def scripted_transcript(env: ToolEnv, seed: int) -> list[tuple[str, str]]:
    """(observation, action) pairs of a correct episode: call the tool, then answer."""
    observation = await env.reset(seed)
    call = call_text(env.task.facts["expression"])
    result = await env.step(call)
    answer = str(env.task.answer)
    final = await env.step(answer)
    assert final.info["success"], final.info
    return [(observation, call), (result.observation, answer)]


def format_warm_up(model, tokenizer, *, demos: int, steps: int, lr: float, batch: int = 8,
                   seed: int = 0) -> list[float]:
    """Supervised steps on scripted sum/difference conversations; returns the losses."""
    env = ToolEnv(sum_or_difference, [calculator],
                  lambda reply, answer, **_: integer_match(reply, answer, which="last"),
                  instructions=tool_arithmetic().instructions, max_turns=3)
    chat = ChatFormat(tokenizer)
    system_prompt, _ = chat.env_prompt(env)
    encoded = [encode_demonstration(chat, system_prompt,
                                    asyncio.run(scripted_transcript(env, 10_000 + s)))
               for s in range(demos)]
    return imitation_steps(model, encoded, tokenizer.pad_token_id, steps=steps, lr=lr,
                           batch=batch, seed=seed)


def called_correctly(episode: Episode) -> bool:
    """A well-formed call whose result (the next observation) is the product asked for."""
    product = str(multiplication_task(episode.seed).answer)
    return bool(episode.info.get("well_formed_calls")) and any(
        "<tool_response>" in t.observation and product in t.observation for t in episode.turns)


def called_share(episodes: list[Episode]) -> tuple[int, int]:
    return sum(map(called_correctly, episodes)), len(episodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=10, help="RL steps")
    parser.add_argument("--episodes", type=int, default=64, help="held-out eval episodes")
    parser.add_argument("--warmup-steps", type=int, default=6)
    parser.add_argument("--warmup-demos", type=int, default=64)
    parser.add_argument("--warmup-lr", type=float, default=2e-5)
    parser.add_argument("--out", default="runs/tool-task")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (1 is faster on a machine shared with other jobs)")
    args = parser.parse_args()
    started = time.perf_counter()
    common = ["--env.name", ENV, "--rollout.max_new_tokens", "40", "--rollout.max_turns", "3",
              "--rollout.group_size", "8", "--rollout.groups_per_step", "4",
              "--eval.episodes", str(args.episodes), "--run.steps", str(args.steps),
              "--run.threads", str(args.threads)]
    base_cfg = load_config(None, ["--model.name", args.model, *common])
    configure_torch(base_cfg.run.threads)

    print(f"# machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"{args.threads} torch threads", flush=True)
    base = load_policy(base_cfg)
    base_result, base_episodes = held_out_eval(base_cfg, base)
    base_called, _ = called_share(base_episodes)
    print(f"base: {format_rate(base_result.successes, base_result.episodes)}, called the "
          f"tool correctly {base_called}/{len(base_episodes)}", flush=True)
    del base, base_episodes  # one model in memory at a time (three copies went past 10 GB)

    model, tokenizer = load_model(args.model, dtype=base_cfg.model.dtype)
    warm_start = time.perf_counter()
    losses = format_warm_up(model, tokenizer, demos=args.warmup_demos,
                            steps=args.warmup_steps, lr=args.warmup_lr)
    warm_dir = Path(tempfile.mkdtemp(prefix="tool-task-warm-"))
    model.save_pretrained(warm_dir)
    tokenizer.save_pretrained(warm_dir)
    print(f"format warm-up: {args.warmup_steps} steps, loss {losses[0]:.2f} -> "
          f"{losses[-1]:.2f}, {time.perf_counter() - warm_start:.0f} s", flush=True)
    del model, tokenizer
    gc.collect()

    rl_cfg = load_config(None, ["--model.name", str(warm_dir), *common, "--run.out_dir",
                                args.out])
    rl_start = time.perf_counter()
    result = train(rl_cfg)
    rl_seconds = time.perf_counter() - rl_start
    warm_called, n = called_share(read_episodes(result.run_dir / "eval_before.jsonl"))
    after_episodes = read_episodes(result.run_dir / "eval_after.jsonl")
    rl_called, _ = called_share(after_episodes)

    rows = [["base model", format_rate(base_result.successes, base_result.episodes),
             format_rate(base_called, base_result.episodes)],
            ["format warm-up", format_rate(result.before.successes, result.before.episodes),
             format_rate(warm_called, n)],
            [f"+ RL {result.steps} steps", format_rate(result.after.successes,
                                                       result.after.episodes),
             format_rate(rl_called, n)]]
    print_table(f"{ENV}: {args.model}, {args.episodes} held-out episodes",
                ["policy", "success [95% CI]", "correct tool call [95% CI]"], rows)
    print(f"RL {rl_seconds / 60:.1f} min, whole run {(time.perf_counter() - started) / 60:.1f}"
          f" min, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; run dir "
          f"{result.run_dir}")
    for episode in after_episodes[:3]:
        print(f"--- sample conversation after RL (seed {episode.seed}, reward "
              f"{episode.reward:g})")
        for turn in episode.turns:
            print(f"policy: {turn.action!r}\nenv:    {turn.observation!r}")


if __name__ == "__main__":
    main()
