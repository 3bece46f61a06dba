"""Side-by-side timings of the CPU savings in rollouts and the update, on the same workload.

1. Multi-turn rollouts: KV cache kept across turns vs re-reading the conversation each turn.
2. The update: scoring only the policy's tokens vs the full ``[B, T, V]`` logits, and
   running the prompt the episodes share once (``optim.shared_prefix``) vs once per episode.

Each variant runs ``--repeats`` times, alternating, after a warm-up; medians and ratios are
printed. Usage: ``python benchmarks/rollout_and_update.py [--model tiny] [--episodes 32]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from functools import partial

import torch

from turnrl.algorithms.losses import token_logprobs
from turnrl.envs import make_env
from turnrl.models import load_model
from turnrl.rollout import ChatFormat, run_episodes
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.trainer.step import micro_batches, score_policy_tokens
from turnrl.types import Batch


def time_it(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model(args.model)
    chat = ChatFormat(tok)
    params = SamplingParams(args.max_new_tokens, 1.0, 1.0, (chat.end_of_turn,))
    make = partial(make_env, "guess-number")
    seeds = [(i, i) for i in range(args.episodes)]
    engines = {"kv kept across turns": HFEngine(model, tok.pad_token_id, reuse_cache=True),
               "re-prefill each turn": HFEngine(model, tok.pad_token_id, reuse_cache=False)}
    episodes = asyncio.run(run_episodes(make, seeds, engines["kv kept across turns"], chat, params))

    batch = Batch.from_episodes(episodes, torch.ones(len(episodes)), tok.pad_token_id)

    def update(mode: str) -> None:
        model.zero_grad()
        for mb in micro_batches(batch, args.micro_batch):
            if mode != "full":
                logprobs, _ = score_policy_tokens(model, mb, 1.0, shared_prefix=mode == "shared")
            else:
                logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
                logprobs = token_logprobs(logits[:, :-1], mb.input_ids[:, 1:])
            (logprobs * mb.loss_mask[:, 1:]).sum().backward()

    variants = {f"rollout: {name}": partial(lambda e: asyncio.run(
        run_episodes(make, seeds, e, chat, params)), engine) for name, engine in engines.items()}
    variants["update: shared prompt once"] = partial(update, "shared")
    variants["update: policy tokens only"] = partial(update, "policy")
    variants["update: full logits"] = partial(update, "full")
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            times[name].append(time_it(fn))

    tokens = sum(len(ep.token_ids) for ep in episodes)
    policy = sum(ep.num_policy_tokens for ep in episodes)
    print(f"model {args.model}, guess-number, {args.episodes} episodes, "
          f"{tokens / len(episodes):.0f} tokens/episode ({policy / len(episodes):.0f} sampled), "
          f"{args.repeats} repeats, 2 threads")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:32s} median {median:7.2f} s   (runs: "
              f"{', '.join(f'{t:.2f}' for t in times[name])})")
    rollout = medians["rollout: re-prefill each turn"] / medians["rollout: kv kept across turns"]
    update_ratio = medians["update: full logits"] / medians["update: policy tokens only"]
    print(f"ratio: rollout re-prefill / kv kept = {rollout:.2f}")
    print(f"ratio: update full logits / policy tokens only = {update_ratio:.2f}")
    shared = medians["update: policy tokens only"] / medians["update: shared prompt once"]
    print(f"ratio: update policy tokens only / shared prompt once = {shared:.2f}")


if __name__ == "__main__":
    main()
