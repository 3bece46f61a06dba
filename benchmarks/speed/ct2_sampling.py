"""Sampling on CPU, side by side: TurnRL's HFEngine (fp32, the learner's own tensors) vs the
CTranslate2 engine (``rollout.sampler ct2``: int8, and fp32 to separate engine from precision)
and, where the CPU has native bf16, the HF engine on a bf16 copy (``rollout.sampler_dtype
bfloat16``), on the offline SmolLM2-135M.

Each engine generates the same batches (``--batches`` sizes of chat prompts, ``--tokens`` new
tokens each, no stop token so every row decodes the full length), run alternately
``--repeats`` times after one warm-up; the table shows median wall seconds, decoded tokens/s
and the ratio to HFEngine fp32, and the mean and largest |log-prob difference| of each
engine's sampled tokens against a float32 forward pass of the same model (the mismatch a
sampler adds, docs/mismatch.md). Then what a new policy version costs each engine
(``load``: CTranslate2 converts and reloads, the bf16 copy copies in place; the HF
engine samples from the learner's tensors, so nothing). The machine's load average is printed
with the figures (a busy machine slows every engine, not always alike). The prompts, rounds,
drift and refresh timing are ``vllm_cpu_sampling.py``'s, the machine and ``ratio:`` lines the
shared harness's (``benchmarks/harness.py``)::

    python benchmarks/speed/ct2_sampling.py [--batches 4 16] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from vllm_cpu_sampling import (  # benchmarks/speed/, this folder
    alternating_rounds,
    batch_of,
    chat_prompts,
    logprob_drift,
    refresh_seconds,
    sampling_arguments,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def load_line() -> str:
    return f"load {harness.load_average():.2f}"


def main() -> None:
    parser = sampling_arguments(__doc__)
    parser.add_argument("--ct2-types", nargs="+", default=["int8", "float32"])
    args = parser.parse_args()

    import torch

    from turnrl.config.precision import cpu_has_bf16
    from turnrl.models import SMOLLM2, load_model
    from turnrl.samplers import HFEngine, SamplingParams
    from turnrl.samplers.copy import HFCopyEngine
    from turnrl.samplers.ct2 import CT2Engine

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(SMOLLM2)
    model.eval()
    prompt_of = chat_prompts(tokenizer)
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0)

    engines = {"hf fp32": HFEngine(model, tokenizer.pad_token_id, seed=0)}
    for compute_type in args.ct2_types:
        engines[f"ct2 {compute_type}"] = CT2Engine(model, compute_type=compute_type,
                                                   threads=args.threads)
    if cpu_has_bf16():
        engines["hf bf16"] = HFCopyEngine(model, torch.bfloat16, tokenizer.pad_token_id)
    else:
        print("this CPU has no native bf16 (avx512_bf16/amx_bf16): the bf16 row is left out")

    load = harness.load_average()
    print(f"SmolLM2-135M, {args.tokens} new tokens a row, {args.threads} threads, median of "
          f"{args.repeats} alternating rounds; {load_line()}")
    print(f"{'batch':>5} {'engine':>16} {'wall s':>8} {'tok/s':>8} {'vs hf':>7} "
          f"{'|dlogp| mean':>12} {'max':>7}")
    for batch in args.batches:
        prompts = batch_of(prompt_of, batch)
        walls, outputs = alternating_rounds(engines, prompts, params, args.repeats)
        base = walls["hf fp32"]
        for name, wall in walls.items():
            mean, largest = logprob_drift(model, prompts, outputs[name])
            print(f"{batch:>5} {name:>16} {wall:8.2f} {batch * args.tokens / wall:8.1f} "
                  f"{base / wall:6.2f}x {mean:12.4f} {largest:7.3f}")
        print(f"      ({load_line()})")
    for name, engine in engines.items():
        if not hasattr(engine, "load"):
            continue
        times = refresh_seconds(engine, model, args.repeats)
        print(f"weight refresh, {name}: median {statistics.median(times):.2f} s "
              f"(of {', '.join(f'{t:.2f}' for t in times)})")
    print(f"({load_line()})")
    print(harness.machine(load))
    fastest = min((n for n in walls if n != "hf fp32"), key=walls.get, default="hf fp32")
    print(harness.ratio_line(f"hf fp32 / {fastest} wall at batch {batch}",
                             base / walls[fastest]))


if __name__ == "__main__":
    main()
