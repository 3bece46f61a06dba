"""Side-by-side timings of HFEngine's decoding optimisations, on SmolLM2 on CPU.

Every section runs its variants alternately, ``--repeats`` times after one warm-up each, on a
fresh engine per run (nothing kept from the previous run), and prints the medians of wall and
CPU seconds and the ratio with / without the optimisation (below 1: it helps):

1. lockstep: guess-number episodes through ``run_episodes`` (a GRPO group's episodes start from
   one prompt), with everything on vs no cache kept across turns vs no shared prefill;
2. continuous: a pool like the continuous loop's, where each call continues a random subset
   of the live episodes and new groups join as others end: per-row cache reuse on vs off
   (the earlier all-or-nothing rule reused the cache only in the calls counted as "old rule");
3. groups: single-turn groups of identical prompts, 16 forced tokens: shared prefill on vs off;
4. uneven replies: one call of up to 64 greedy tokens that stop at the end of turn or at
   punctuation, so rows stop at different steps: compaction on vs off;
5. decode step: keys/values written in place in a preallocated buffer vs concatenated onto a
   ``DynamicCache`` at every step; sampling by inverse CDF vs ``torch.multinomial``.

``--baseline FILE`` adds the ``HFEngine`` of another hf_engine.py (e.g. the previous version,
from ``git show``) to sections 1-4. Usage: ``python benchmarks/decode.py [--threads 2]``.
On a machine shared with other jobs, ``OMP_WAIT_POLICY=PASSIVE`` keeps the 2 threads from
spinning while they wait for a core (several times slower, and far noisier, otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
from transformers import DynamicCache

from turnrl.envs import make_env
from turnrl.models import load_model
from turnrl.rollout import ChatFormat, run_episodes
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.samplers.base import Completion, sample_tokens
from turnrl.samplers.hf import _Batch, _sample


def measure(variants: dict[str, Callable[[], object]], repeats: int
            ) -> dict[str, tuple[float, float]]:
    """Median (wall, cpu) seconds of each variant, run alternately after one warm-up each."""
    for fn in variants.values():
        fn()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            runs[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    medians = {}
    for name, times in runs.items():
        walls, cpus = [w for w, _ in times], [c for _, c in times]
        medians[name] = (statistics.median(walls), statistics.median(cpus))
        print(f"  {name:34s} wall {medians[name][0]:7.2f} s  cpu {medians[name][1]:7.2f} s"
              f"   (wall runs: {', '.join(f'{w:.2f}' for w in walls)})")
    return medians


def report(medians: dict[str, tuple[float, float]], better: str, plain: str) -> float:
    wall = medians[better][0] / medians[plain][0]
    cpu = medians[better][1] / medians[plain][1]
    print(f"  -> {better} / {plain}: wall {wall:.2f}, cpu {cpu:.2f}")
    return wall


def lockstep(engine: Callable[[], object], chat: ChatFormat, params: SamplingParams,
             seeds: list[tuple[int, int]]) -> None:
    make = partial(make_env, "guess-number", max_turns=3)
    asyncio.run(run_episodes(make, seeds, engine(), chat, params))


def continuous(engine: Callable[[], object], chat: ChatFormat, params: SamplingParams,
               groups: int, group_size: int, turns: int = 3) -> tuple[int, int]:
    """A continuous-loop-like pattern; returns (calls, calls the old all-or-nothing rule hit)."""
    engine = engine()
    rng = random.Random(0)  # the same subsets for every engine
    env = make_env("guess-number")
    first = chat.start(asyncio.run(env.reset(0)), env.system_prompt)[2]
    reply = chat.encode("\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n")
    live: list[list] = []  # [id, tokens, turns left]
    admitted, calls, old_rule_hits, previous = 0, 0, 0, set()
    while live or admitted < groups:
        while admitted < groups and len(live) + group_size <= 2 * group_size:
            live += [[(admitted, i), list(first), turns] for i in range(group_size)]
            admitted += 1
        waiting = rng.sample(live, max(1, round(len(live) * rng.uniform(0.4, 0.9))))
        ids = {episode[0] for episode in waiting}
        old_rule_hits += ids <= previous
        previous = ids
        completions = engine.generate([episode[1] for episode in waiting], params)
        calls += 1
        for episode, completion in zip(waiting, completions, strict=True):
            episode[1] += completion.token_ids + reply
            episode[2] -= 1
        live = [episode for episode in live if episode[2] > 0]
    return calls, old_rule_hits


class NoModel:
    """An engine that replies nothing, to count the calls of a pattern without a model."""

    def generate(self, prompts, params):
        return [Completion() for _ in prompts]


def groups_once(engine: Callable[[], object], prompts: list[list[int]],
                params: SamplingParams) -> None:
    engine().generate(prompts, params)


@torch.no_grad()
def decode_steps(model, rows: int, past: int, steps: int, in_place: bool) -> None:
    """``steps`` one-token forward passes over a ``past``-token cache of ``rows`` rows."""
    config = model.config
    shape = (rows, config.num_key_value_heads, past,
             config.hidden_size // config.num_attention_heads)
    tokens = torch.full((rows,), 1, dtype=torch.long)
    if in_place:
        kv = torch.zeros((config.num_hidden_layers, 2) + shape[:2] + (past + steps, shape[3]))
        mask = torch.ones((rows, past + steps), dtype=torch.bool)
        batch = _Batch(kv, mask, past, torch.full((rows,), past))
        for _ in range(steps):
            batch.step(model, tokens, torch.ones(rows, dtype=torch.bool))
        return
    cache = DynamicCache(ddp_cache_data=[(torch.zeros(shape), torch.zeros(shape))
                                         for _ in range(config.num_hidden_layers)])
    mask = torch.ones((rows, past), dtype=torch.long)
    for step in range(steps):
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long)], dim=1)
        model(input_ids=tokens[:, None], attention_mask=mask, past_key_values=cache,
              position_ids=torch.full((rows, 1), past + step), use_cache=True)


def load_engine_class(path: str) -> type:
    spec = importlib.util.spec_from_file_location("baseline_hf_engine", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.HFEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--baseline", help="an hf_engine.py whose HFEngine to time as well")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    model.eval()
    chat = ChatFormat(tok)
    pad = tok.pad_token_id

    def engine(**flags) -> Callable[[], HFEngine]:
        return lambda: HFEngine(model, pad, seed=0, **flags)

    baseline = {}
    if args.baseline:
        old = load_engine_class(args.baseline)
        baseline = {"baseline (--baseline)": lambda: old(model, pad, seed=0)}
    end = (chat.end_of_turn,)
    short = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=end)
    seeds = [(g, g) for g in range(args.groups) for _ in range(args.group_size)]
    print(f"model {args.model}, {args.threads} threads, {args.groups} groups of "
          f"{args.group_size}, {args.repeats} repeats; medians")
    ratios = {}

    print("1. lockstep: guess-number, up to 3 turns of up to 8 tokens")
    variants = {name: partial(lockstep, factory, chat, short, seeds) for name, factory in {
        "all on": engine(), "no cache across turns": engine(reuse_cache=False),
        "no shared prefill": engine(share_prompts=False), **baseline}.items()}
    medians = measure(variants, args.repeats)
    ratios["lockstep reuse"] = report(medians, "all on", "no cache across turns")
    ratios["lockstep shared"] = report(medians, "all on", "no shared prefill")
    if baseline:
        ratios["lockstep vs baseline"] = report(medians, "all on", "baseline (--baseline)")

    calls, hits = continuous(NoModel, chat, short, args.groups, args.group_size)
    print(f"2. continuous: {calls} calls over changing row subsets, 3 turns per episode "
          f"(old rule: cache reused in {hits} of {calls} calls)")
    variants = {name: partial(continuous, factory, chat, short, args.groups, args.group_size)
                for name, factory in {"per-row reuse": engine(),
                                      "no reuse": engine(reuse_cache=False), **baseline}.items()}
    medians = measure(variants, args.repeats)
    ratios["continuous reuse"] = report(medians, "per-row reuse", "no reuse")
    if baseline:
        ratios["continuous vs baseline"] = report(medians, "per-row reuse",
                                                  "baseline (--baseline)")

    print("3. groups: single turn, identical prompts per group, 16 forced tokens")
    env = make_env("guess-number")
    prompt = chat.start(asyncio.run(env.reset(0)), env.system_prompt)[2]
    forced = SamplingParams(max_new_tokens=16, temperature=1.0)
    prompts = [prompt + chat.encode(f" (game {g})") for g, _ in seeds]
    variants = {name: partial(groups_once, factory, prompts, forced) for name, factory in {
        "shared prefill": engine(), "no shared prefill": engine(share_prompts=False),
        **baseline}.items()}
    medians = measure(variants, args.repeats)
    ratios["groups shared"] = report(medians, "shared prefill", "no shared prefill")

    print("4. uneven replies: one call, up to 64 tokens, greedy (the same replies both ways), "
          "stop at end of turn or punctuation")
    stops = (chat.end_of_turn, *{t for text in (".", ",", "!", "\n") for t in chat.encode(text)})
    uneven = SamplingParams(max_new_tokens=64, temperature=0.0, stop_token_ids=stops)
    lengths = sorted(len(c.token_ids) for c in engine()().generate(prompts, uneven))
    print(f"  reply lengths: {lengths}")
    variants = {name: partial(groups_once, factory, prompts, uneven) for name, factory in {
        "compaction": engine(), "no compaction": engine(compact=False), **baseline}.items()}
    medians = measure(variants, args.repeats)
    ratios["uneven replies compaction"] = report(medians, "compaction", "no compaction")

    rows = args.groups * args.group_size
    print(f"5. decode step: {rows} rows, 200 cached tokens, 8 steps; sampler on {rows} rows")
    medians = measure({"in place": partial(decode_steps, model, rows, 200, 8, True),
                       "concatenated": partial(decode_steps, model, rows, 200, 8, False)},
                      args.repeats)
    ratios["decode step in place"] = report(medians, "in place", "concatenated")
    logits = torch.randn(rows, model.config.vocab_size) * 3
    generator = torch.Generator().manual_seed(0)
    medians = measure({"inverse CDF": lambda: [_sample(logits, short, generator)
                                               for _ in range(20)],
                       "multinomial": lambda: [sample_tokens(logits, 1.0, 1.0, generator)
                                               for _ in range(20)]}, args.repeats)
    ratios["sampler"] = report(medians, "inverse CDF", "multinomial")
    print("ratio: " + ", ".join(f"{name} {ratio:.2f}" for name, ratio in ratios.items()))


if __name__ == "__main__":
    main()
