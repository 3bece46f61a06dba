"""How far each stage of a GRPO step is from what this machine's hardware allows.

Two floors, both from rates measured here at run time (never a vendor's figure):

- **generation**: each decode step reads every weight of the sampler once (the whole batch
  shares the read; an untied input embedding is a lookup) and does ``2 x parameters`` FLOPs
  per row, so a step costs at least the
  larger of ``weight bytes / memory read bandwidth`` and ``2 x parameters x rows / peak
  FLOP rate``; the prompt's prefill adds ``2 x parameters x prompt tokens`` FLOPs once per
  distinct prompt. Sampling itself and attention are left out, so the floor is optimistic.
- **the update**: a forward and backward pass cost about ``6 x parameters x tokens`` FLOPs
  (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1). The tokens
  are the work a step cannot avoid: each distinct prompt once (a GRPO group's rows share
  theirs) and every completion token; the LM head (a ``vocab x hidden`` matmul) runs only on
  the completion tokens, the ones the loss needs. Attention's ``T^2`` term is small at these
  lengths and left out. Divided by the peak matmul rate at the update's dtype (float32, or
  bf16 under ``optim.compute_dtype``).

Rates are ceilings: the best of several repeats, not the median. Not a side-by-side timing:
of the shared harness (``benchmarks/harness.py``) it takes the timed call and, alone, the
machine line and a last ``ratio: bf16 / fp32 matmul rate = X`` line (below 1: no native
bf16), not the alternating rounds.

Usage: imported by ``step_throughput.py`` (a table after its workloads); alone,
``python benchmarks/speed/hardware_limits.py [--threads 2]`` prints the measured rates.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


@dataclass(frozen=True)
class Rates:
    """This machine's measured ceilings at one thread count."""

    read_gb_s: float
    """Memory read bandwidth: a sum over a buffer far larger than the caches."""
    fp32_gflops: float
    """Peak float32 matmul rate (square matmuls large enough to be compute-bound)."""
    bf16_gflops: float
    """The same in bfloat16 (emulated, slower, on a CPU without native bf16)."""
    threads: int


def _best_seconds(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (a ceiling: what the hardware can do, not what a
    busy machine happened to give), after one untimed warm-up call."""
    fn()  # warm-up: page faults, thread pool start, kernel selection
    return min(harness.timed(fn)[0] for _ in range(repeats))


def measure_rates(threads: int, buffer_mb: int = 1024, matmul_n: int = 1536,
                  repeats: int = 10) -> Rates:
    """Read bandwidth and peak matmul rates with ``threads`` torch threads (restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(buffer_mb * 2**20 // 4, dtype=torch.float32)
        read_s = _best_seconds(lambda: buffer.sum(), repeats)
        read_gb_s = buffer.numel() * 4 / read_s / 1e9
        buffer = None  # free the GB before the matmuls
        flops = {}
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(matmul_n, matmul_n).to(dtype)
            b = torch.randn(matmul_n, matmul_n).to(dtype)
            seconds = _best_seconds(lambda a=a, b=b: a @ b, repeats)
            flops[dtype] = 2 * matmul_n**3 / seconds / 1e9
    finally:
        torch.set_num_threads(before)
    return Rates(read_gb_s, flops[torch.float32], flops[torch.bfloat16], threads)


@dataclass(frozen=True)
class ModelSize:
    """What the floors need to know of a model: its parameters, split at the LM head."""

    params: int
    """All parameters (tied embeddings counted once)."""
    head_params: int
    """The LM head's ``vocab x hidden`` (tied to the input embedding in SmolLM2)."""
    tied: bool
    """The head is the input embedding (a lookup, no FLOPs); untied, the embedding is a
    separate tensor read by lookup only."""

    @property
    def decoder_params(self) -> int:
        """The parameters every token's forward and backward pass through (not the head, not
        the input embedding)."""
        embedding = 0 if self.tied else self.head_params
        return self.params - self.head_params - embedding

    @property
    def decode_params(self) -> int:
        """The parameters a decode step reads and multiplies by: the decoder and the head (an
        untied input embedding is read one row per token, a lookup)."""
        return self.decoder_params + self.head_params


def model_size(model_dir: str) -> ModelSize:
    """Counted on the meta device from the model's config: no weights are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # shared tensors are yielded once
    head = model.get_output_embeddings().weight
    tied = head is model.get_input_embeddings().weight
    return ModelSize(params, head.numel(), tied)


SAMPLER_BYTES = {"auto": 4.0, "float32": 4.0, "bfloat16": 2.0, "int8": 1.0,
                 "int8_float32": 1.0}
"""Bytes per weight the sampler reads, by ``rollout.sampler_dtype`` (auto: the float32
learner's own weights)."""


def peak_flops(rates: Rates, dtype: str) -> float:
    """FLOP/s ceiling of matmuls in ``dtype``: bf16's where the weights are bf16 or int8 (no
    int8 rate is measured; bf16's stands in for it), float32's otherwise."""
    return 1e9 * (rates.bf16_gflops if dtype in ("bfloat16", "int8", "int8_float32")
                  else rates.fp32_gflops)


def floors(size: ModelSize, rates: Rates, *, prompts: int, rows: int, prompt_tokens: float,
           completion_tokens: int, sampler_dtype: str, update_dtype: str) -> dict[str, float]:
    """Floor seconds of one step's generation and update (see the module docstring);
    ``prompts`` distinct prompts of ``prompt_tokens`` each, ``rows`` completions of
    ``completion_tokens`` each."""
    weight_bytes = size.decode_params * SAMPLER_BYTES[sampler_dtype]
    sampler_peak = peak_flops(rates, sampler_dtype)
    decode_step = max(weight_bytes / (rates.read_gb_s * 1e9),
                      2 * size.decode_params * rows / sampler_peak)
    prefill = 2 * size.decode_params * prompts * prompt_tokens / sampler_peak
    update_flops = 6 * (size.decoder_params * (prompts * prompt_tokens + rows * completion_tokens)
                        + size.head_params * rows * completion_tokens)
    return {"gen_floor_s": completion_tokens * decode_step + prefill,
            "update_floor_s": update_flops / peak_flops(rates, update_dtype),
            "update_gflop": update_flops / 1e9, "weight_gb": weight_bytes / 1e9}


def limits_table(size: ModelSize, rates: Rates, workloads: list[dict]) -> list[list[str]]:
    """One row per stage and workload: measured, floor, and how many times the floor."""
    rows = []
    for entry in workloads:
        wl, r = entry["workload"], entry["systems"].get("turnrl")
        if r is None:
            continue
        f = floors(size, rates, prompts=wl["prompts"], rows=int(r["completions_per_step"]),
                   prompt_tokens=r["prompt_tokens"], completion_tokens=wl["completion_length"],
                   sampler_dtype=wl["engine_dtype"], update_dtype=wl["compute_dtype"])
        entry["floors"] = f
        rows.append([f"G={wl['group_size']} gen", f"{r['median_gen_s']:.3f}",
                     f"{f['gen_floor_s']:.3f}", f"{r['median_gen_s'] / f['gen_floor_s']:.1f}x",
                     f"{wl['completion_length']} decode steps x {f['weight_gb']:.2f} GB of "
                     f"weights / {rates.read_gb_s:.1f} GB/s (or FLOPs where more)"])
        peak = peak_flops(rates, wl["compute_dtype"]) / 1e9
        rows.append([f"G={wl['group_size']} update", f"{r['median_update_s']:.3f}",
                     f"{f['update_floor_s']:.3f}",
                     f"{r['median_update_s'] / f['update_floor_s']:.1f}x",
                     f"{f['update_gflop']:.0f} GFLOP / {peak:.0f} GFLOP/s "
                     f"({wl['compute_dtype']})"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    load = harness.load_average()
    r = measure_rates(args.threads)
    print(f"{r.threads} thread(s): memory read {r.read_gb_s:.1f} GB/s, matmul float32 "
          f"{r.fp32_gflops:.0f} GFLOP/s, bfloat16 {r.bf16_gflops:.0f} GFLOP/s")
    print(harness.machine(load))
    print(harness.ratio_line("bf16 / fp32 matmul rate", r.bf16_gflops / r.fp32_gflops))


if __name__ == "__main__":
    main()
