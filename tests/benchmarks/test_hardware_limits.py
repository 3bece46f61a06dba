"""``benchmarks/speed/hardware_limits.py``: the floors each stage of a step is held against."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks" / "speed"))
import hardware_limits as hw  # noqa: E402

RATES = hw.Rates(read_gb_s=1.0, fp32_gflops=10.0, bf16_gflops=20.0, threads=1)


def test_floors_by_hand_tied_head():
    size = hw.ModelSize(params=1000, head_params=200, tied=True)
    assert size.decoder_params == 800
    f = hw.floors(size, RATES, prompts=1, rows=2, prompt_tokens=3, completion_tokens=4,
                  sampler_dtype="float32", update_dtype="float32")
    # a decode step: 4 kB of weights at 1 GB/s (4e-6 s) beats 2 x 1000 x 2 rows FLOPs at
    # 10 GFLOP/s (4e-7 s); the prefill: 2 x 1000 x 3 FLOPs once
    assert f["gen_floor_s"] == pytest.approx(4 * 4e-6 + 2 * 1000 * 3 / 1e10)
    # the decoder on the shared prompt once and on 2 x 4 completion tokens, the head on the
    # completion tokens only; x6 for forward and backward
    assert f["update_gflop"] == pytest.approx(6 * (800 * (3 + 8) + 200 * 8) / 1e9)
    assert f["update_floor_s"] == pytest.approx(f["update_gflop"] / 10)
    low = hw.floors(size, RATES, prompts=1, rows=2, prompt_tokens=3, completion_tokens=4,
                    sampler_dtype="int8", update_dtype="bfloat16")
    assert low["update_floor_s"] == pytest.approx(f["update_floor_s"] / 2)
    assert low["gen_floor_s"] == pytest.approx(4 * 1e-6 + 2 * 1000 * 3 / 2e10)  # 1 B weights


def test_a_large_batch_makes_decoding_compute_bound():
    size = hw.ModelSize(params=1000, head_params=200, tied=True)
    f = hw.floors(size, RATES, prompts=2, rows=64, prompt_tokens=0, completion_tokens=1,
                  sampler_dtype="float32", update_dtype="float32")
    # 2 x 1000 x 64 FLOPs at 10 GFLOP/s = 1.28e-5 s, more than the 4e-6 s weight read
    assert f["gen_floor_s"] == pytest.approx(2 * 1000 * 64 / 1e10)


def test_an_untied_embedding_is_neither_decoder_compute_nor_read_per_decode_step():
    untied = hw.ModelSize(params=1200, head_params=200, tied=False)
    assert untied.decoder_params == 800 and untied.decode_params == 1000
    tied = hw.ModelSize(params=1000, head_params=200, tied=True)
    args = dict(prompts=1, rows=2, prompt_tokens=3, completion_tokens=4,
                sampler_dtype="float32", update_dtype="float32")
    assert hw.floors(untied, RATES, **args) == hw.floors(tied, RATES, **args)


def test_model_size_counts_the_real_model(tiny, tmp_path):
    model, tokenizer = tiny
    model.save_pretrained(tmp_path)
    size = hw.model_size(str(tmp_path))
    assert size.params == sum(p.numel() for p in model.parameters())
    assert size.head_params == model.get_output_embeddings().weight.numel()
    assert size.tied == (model.get_output_embeddings().weight
                         is model.get_input_embeddings().weight)


def test_rates_are_measured_and_the_thread_count_restored():
    before = torch.get_num_threads()
    rates = hw.measure_rates(1, buffer_mb=64, matmul_n=256, repeats=2)
    assert torch.get_num_threads() == before
    for value in (rates.read_gb_s, rates.fp32_gflops, rates.bf16_gflops):
        assert math.isfinite(value) and value > 0
