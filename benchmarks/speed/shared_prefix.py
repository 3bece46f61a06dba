"""The update with a group's shared prompt run once, packed vs cached, vs once per episode.

One GRPO-shaped batch per group size: a prompt of ``--prompt`` tokens, ``G`` completions of
``--completion`` tokens each (the shapes of ``benchmarks/speed/step_throughput.py``'s arithmetic
step). Each variant is a whole ``policy_update`` (forward, backward, AdamW step):

- packed: the prompt and the group's completions in one sequence with a block mask;
- cached: the prompt through the decoder first, the completions against its key/value cache;
- per episode: ``optim.shared_prefix false``.

The update itself takes packed where ``packing_pays`` (each line says which it picks); here
both are forced, to time the rule's choice against the other. Variants alternate within each
round after a warm-up; medians and ratios are printed. Usage: ``python
benchmarks/speed/shared_prefix.py [--model tiny] [--groups 4 16] [--prompt 44] [--completion 16]
[--rounds 5]``.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

from turnrl.config import AlgoConfig, OptimConfig
from turnrl.models import load_model
from turnrl.trainer import prefix
from turnrl.trainer.step import UpdateSettings, make_optimizer, micro_batches, policy_update
from turnrl.types import Batch, Episode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

VARIANTS = ("packed", "cached", "per episode")


def group_batch(group_size: int, prompt: int, completion: int, vocab: int) -> Batch:
    """``group_size`` single-turn episodes that share one random prompt."""
    rng = torch.Generator().manual_seed(group_size)
    shared = torch.randint(100, vocab, (prompt,), generator=rng).tolist()
    episodes = []
    for _ in range(group_size):
        ep = Episode(env="bench", seed=0, group=0)
        ep.append(shared, policy=False)
        ep.append(torch.randint(100, vocab, (completion,), generator=rng).tolist(), policy=True,
                  logprobs=[-2.0] * completion, version=0)
        episodes.append(ep)
    return Batch.from_episodes(episodes, torch.linspace(-1, 1, group_size), pad_id=0)


def rule_pick(model, batch: Batch) -> str:
    """The path ``shared_prefix_hidden`` takes for this batch's micro-batches."""
    if prefix._mask_format(model.get_decoder()) is None:
        return "cached"
    picks = set()
    for mb in micro_batches(batch, OptimConfig().micro_batch_size):
        split = prefix.shared_prefix_split(mb)
        pays = prefix.packing_pays(model.config, prefix.PackedLayout.of(mb, split), split, mb)
        picks.add("packed" if pays else "cached")
    return "/".join(sorted(picks))


def forced_update(model, optimizer, batch: Batch, variant: str, completion: int) -> None:
    """One ``policy_update`` down ``variant``'s path, whatever the rule would pick."""
    settings = UpdateSettings(AlgoConfig(), OptimConfig(shared_prefix=variant != "per episode"),
                              temperature=1.0, agg_constant=completion)
    pays = prefix.packing_pays
    prefix.packing_pays = lambda *args: variant == "packed"  # force the path to time it
    try:
        policy_update(model, optimizer, batch, settings)
    finally:
        prefix.packing_pays = pays


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--prompt", type=int, default=44, help="prompt tokens (default 44)")
    parser.add_argument("--completion", type=int, default=16,
                        help="tokens per completion (default 16)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    if prefix._mask_format(model.get_decoder()) is None:
        raise SystemExit(f"shared_prefix: {model.config.model_type} with "
                         f"{model.config._attn_implementation} attention cannot run the packed "
                         f"path (turnrl/trainer/prefix.py: PACKABLE_MODELS); nothing to compare")
    optimizer = make_optimizer(model, OptimConfig(lr=1e-7))
    vocab = model.config.vocab_size
    print(f"model {args.model}, prompt {args.prompt} tokens, completions {args.completion} "
          f"tokens, micro-batch {OptimConfig().micro_batch_size} rows, {args.threads} threads, "
          f"{args.rounds} rounds; seconds per policy_update (median)")
    results, load = [], harness.load_average()
    for group_size in args.groups:
        batch = group_batch(group_size, args.prompt, args.completion, vocab)
        rounds = harness.alternate({v: partial(forced_update, model, optimizer, batch, v,
                                               args.completion) for v in VARIANTS}, args.rounds)
        medians = rounds.medians()
        cells = "  ".join(f"{v} {m:.3f}" for v, m in medians.items())
        print(f"G={group_size:<3d} {cells}  (the update picks {rule_pick(model, batch)})")
        print(f"ratio: G={group_size} cached/packed = {medians['cached'] / medians['packed']:.2f}"
              f", per episode/packed = {medians['per episode'] / medians['packed']:.2f}")
        results.append({"group": group_size, "pick": rule_pick(model, batch), **medians})
    print(harness.machine(load))
    print(harness.ratio_line(f"G={group_size} per episode/packed update seconds",
                             medians["per episode"] / medians["packed"]))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
