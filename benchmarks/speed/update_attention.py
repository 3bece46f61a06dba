"""Where a bf16-autocast update's time goes, and whether another attention kernel helps.

One forward and backward of the update's shape (``rows x tokens``, the last ``scored`` tokens
through the LM head and a float32 log-softmax, as ``turnrl.trainer.step`` does), profiled with
``torch.profiler`` (top operators by self CPU time, float32 and bf16), then timed in
alternating rounds with three attention variants under bf16 autocast:

- ``sdpa``: the stock ``scaled_dot_product_attention`` (what TurnRL runs);
- ``sdpa32``: the same, with query, key and value cast to float32 and autocast off inside;
- ``eager``: transformers' matmul-softmax-matmul attention.

Usage: ``python benchmarks/speed/update_attention.py [--model smollm2-135m-instruct] [--threads 1]
[--shapes 4x160x64 16x96x32 4x512x256] [--rounds 3]``. Run it on an idle machine: the
profile's shares survive load, its times do not. The rounds (one warm-up each first), the
machine line and the last line, ``ratio: sdpa32 / sdpa bf16 update seconds at SHAPE = X``
(the last shape), are the shared harness's (``benchmarks/harness.py``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from turnrl.algorithms.losses import token_logprobs
from turnrl.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def sdpa_in_float32(module, query, key, value, attention_mask, **kwargs):
    """SDPA with its inputs in float32 and autocast off: the attention of a bf16 update run at
    full precision (CPU flash attention's bf16 backward is slower than its fp32 one)."""
    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                              attention_mask, **kwargs)
    return out.to(query.dtype), weights


AttentionInterface.register("sdpa32", sdpa_in_float32)


def update_pass(model, ids: torch.Tensor, scored: int, bf16: bool) -> torch.Tensor:
    """One forward and backward; the scored tokens' log-probs (detached)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        logits = model.get_output_embeddings()(
            hidden[:, -scored - 1:-1].reshape(-1, hidden.shape[-1]))
    logprobs = token_logprobs(logits.float(), ids[:, -scored:].reshape(-1))
    (-logprobs.mean()).backward()
    return logprobs.detach()


def top_operators(model, ids, scored: int, bf16: bool, n: int = 6) -> list[tuple[str, float]]:
    """The ``n`` operators with the most self CPU time, as shares of the total."""
    update_pass(model, ids, scored, bf16)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update_pass(model, ids, scored, bf16)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:n]
    return [(e.key, e.self_cpu_time_total / total) for e in ranked]


def bf16_update(model, impl: str, ids: torch.Tensor, scored: int) -> Callable[[], object]:
    """A bf16 ``update_pass`` with the attention ``impl`` (a variant for the harness)."""
    def run() -> torch.Tensor:
        model.config._attn_implementation = impl
        return update_pass(model, ids, scored, bf16=True)
    return run


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", nargs="+", default=["4x160x64", "16x96x32", "4x512x256"],
                        help="rows x tokens x scored tokens")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    model.train()
    load = harness.load_average()
    results = {}
    for shape in args.shapes:
        rows, tokens, scored = (int(x) for x in shape.split("x"))
        ids = torch.randint(0, model.config.vocab_size, (rows, tokens),
                            generator=torch.Generator().manual_seed(0))
        model.config._attn_implementation = "sdpa"
        for bf16 in (False, True):
            ops = top_operators(model, ids, scored, bf16)
            print(f"{shape} {'bf16' if bf16 else 'fp32'} profile: "
                  + ", ".join(f"{name} {100 * share:.0f}%" for name, share in ops))
        rounds = harness.alternate({impl: bf16_update(model, impl, ids, scored)
                                    for impl in ("sdpa", "sdpa32", "eager")},
                                   args.rounds, warmup=1)
        model.config._attn_implementation = "sdpa"
        medians = rounds.medians()
        print(f"{shape} bf16 update, median s: " + ", ".join(
            f"{impl} {t:.3f} ({t / medians['sdpa']:.2f}x)" for impl, t in medians.items()))
        results[shape] = medians
    print(harness.machine(load))
    print(harness.ratio_line(f"sdpa32 / sdpa bf16 update seconds at {shape}",
                             harness.ratio_of_medians(rounds.wall["sdpa32"],
                                                      rounds.wall["sdpa"])))
    return results


if __name__ == "__main__":
    main()
