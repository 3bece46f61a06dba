"""What the live-token hook costs ``HFEngine``: one batch of sampled replies, side by side.

Variants, run alternately after a warm-up each, on a fresh engine per run with the same seed
(so each samples the same tokens and does the same work):

- ``baseline``: the ``HFEngine`` of another hf_engine.py (``--baseline``, e.g. main's from
  ``git show main:turnrl/samplers/hf.py > /tmp/hf_engine_main.py``), if given;
- ``no hook``: this engine as training rollouts call it (``on_step`` not given);
- ``hook``: with a no-op ``on_step`` (the engine's side of streaming: one list a step).

Prints median wall and CPU seconds and their ratios to ``no hook``, with the machine's
load (on a shared machine the CPU time is the steadier figure).
Usage: ``python benchmarks/stream_hook.py [--model tiny] [--baseline FILE]``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
from decode import load_engine_class, measure

from turnrl.models import load_model
from turnrl.rollout import ChatFormat
from turnrl.samplers import HFEngine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="an hf_engine.py whose HFEngine to time as well")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    model.eval()
    chat = ChatFormat(tokenizer)
    prompts = [chat.start(f"Tell me about the number {i} in one paragraph.")[2]
               for i in range(args.rows)]
    # No stop token: every row decodes all its tokens, so every variant does the same work.
    params = SamplingParams(args.tokens, 1.0, 1.0, stop_token_ids=())
    pad = tokenizer.pad_token_id

    def run(factory: Callable[[], object], **hook) -> Callable[[], object]:
        return lambda: factory().generate(prompts, params, **hook)

    variants = {"no hook": run(lambda: HFEngine(model, pad, seed=0)),
                "hook": run(lambda: HFEngine(model, pad, seed=0), on_step=lambda tokens: None)}
    if args.baseline:
        old = load_engine_class(args.baseline)
        variants["baseline"] = run(lambda: old(model, pad, seed=0))
    medians = measure(variants, args.repeats)
    print(f"model {args.model}, {args.rows} rows x {args.tokens} tokens, {args.threads} "
          f"thread(s), {args.repeats} repeats; cpu_count {os.cpu_count()}, "
          f"loadavg {os.getloadavg()[0]:.1f}")
    wall0, cpu0 = medians["no hook"]
    for name, (wall, cpu) in medians.items():
        print(f"  {name:10s} wall {wall:.3f} s (ratio {wall / wall0:.3f})   "
              f"cpu {cpu:.3f} s (ratio {cpu / cpu0:.3f})")


if __name__ == "__main__":
    main()
