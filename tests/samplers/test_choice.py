"""``rollout.sampler auto``'s choice (turnrl/samplers/choice.py): a lock-step step's
estimated sampler cost is the probe's sampling scaled to the step's work plus one weight
refresh, and another engine must beat the default's by the margin. Hand-computed figures;
then the probe itself on real tiny HF engines."""

from __future__ import annotations

import pytest
import torch

from turnrl.models import tiny_model
from turnrl.policy import publish
from turnrl.samplers.choice import (
    MARGIN,
    Shape,
    Timings,
    describe,
    pick_fastest,
    probe_shape,
    step_seconds,
    time_engines,
)
from turnrl.samplers.copy import HFCopyEngine
from turnrl.samplers.hf import HFEngine

PROBE = Shape(rows=32, turns=2, new_tokens=8)
STEP = Shape(rows=32, turns=8, new_tokens=8)
"""The default job's shape: 8 x 4 rows, 8 turns of 8 tokens; 4x the probe's work."""


@pytest.mark.parametrize("step,expected", [
    (STEP, 4 * 1.5 + 0.25),
    (Shape(32, 2, 8), 1.5 + 0.25),  # the probe's own shape: the sampling as timed
    (Shape(32, 1, 8), 0.75 + 0.25),  # one-turn env: half the probe's two turns
    (Shape(64, 8, 8), 8 * 1.5 + 0.25),  # twice the rows (past MAX_ROWS)
    (Shape(32, 8, 64), 32 * 1.5 + 0.25),  # 8x the tokens (past MAX_PROBE_TOKENS)
    (Shape(96, 3, 16), 3 * 1.5 * 2 * 1.5 + 0.25),
])
def test_step_seconds_scales_the_sampling_and_adds_one_refresh(step, expected):
    assert step_seconds(1.5, 0.25, PROBE, step) == pytest.approx(expected)


def test_step_seconds_with_no_refresh_is_the_scaled_sampling():
    assert step_seconds(2.0, 0.0, PROBE, STEP) == pytest.approx(8.0)
    assert step_seconds(0.0, 3.0, PROBE, STEP) == pytest.approx(3.0)


@pytest.mark.parametrize("ct2_sample_s,ct2_refresh_s,chosen", [
    # hf: 1.0 s a probe x 4 = 4.0 s a step, refresh free
    (0.5, 3.0, "hf float32"),  # 2x faster sampling (saves 2.0 s) but a 3.0 s refresh: 5.0 s
    (0.5, 2.5, "hf float32"),  # saves 2.0, refresh 2.5: 4.5 s
    (0.5, 1.0, "ct2 int8"),  # saves 2.0, refresh 1.0: 3.0 s, 4.0 / 3.0 = 1.33 >= 1.15
    (0.5, 1.6, "hf float32"),  # saves 2.0, refresh 1.6: 3.6 s, 4.0 / 3.6 = 1.11 < 1.15
    (0.25, 0.5, "ct2 int8"),  # 4x faster (saves 3.0), refresh 0.5: 1.5 s
    (1.5, 0.0, "hf float32"),  # slower sampling, free refresh: 6.0 s
])
def test_the_refresh_can_outweigh_faster_sampling(ct2_sample_s, ct2_refresh_s, chosen):
    step_s = {"hf float32": step_seconds(1.0, 0.0, PROBE, STEP),
              "ct2 int8": step_seconds(ct2_sample_s, ct2_refresh_s, PROBE, STEP)}
    assert pick_fastest(step_s, default="hf float32") == chosen


def test_a_longer_step_makes_the_same_refresh_worth_it():
    """ct2 samples 2x faster with a 3.0 s refresh: loses on the default 8-turn step of 8
    tokens (4.0 s vs 5.0 s), wins when each step samples 8x more tokens (32 s vs 19 s)."""
    long_step = Shape(32, 8, 64)
    for step, chosen in ((STEP, "hf float32"), (long_step, "ct2 int8")):
        step_s = {"hf float32": step_seconds(1.0, 0.0, PROBE, step),
                  "ct2 int8": step_seconds(0.5, 3.0, PROBE, step)}
        assert pick_fastest(step_s, default="hf float32") == chosen


@pytest.mark.parametrize("step_s,chosen", [
    ({"hf float32": 2.0, "ct2 int8": 1.0}, "ct2 int8"),
    ({"hf float32": 2.0, "ct2 int8": 1.8}, "hf float32"),  # 1.11x: under the margin
    ({"hf float32": 1.0, "ct2 int8": 3.0, "hf bfloat16": 0.5}, "hf bfloat16"),
    ({"hf float32": 1.0, "ct2 int8": 1.0 / MARGIN}, "ct2 int8"),  # exactly the margin
    ({"hf float32": 1.0, "ct2 int8": 1.0 / MARGIN + 1e-9}, "hf float32"),
    ({"hf float32": 1.0, "ct2 int8": 0.7, "hf bfloat16": 0.8}, "ct2 int8"),  # the cheapest
])
def test_pick_fastest_needs_the_margin_over_the_default(step_s, chosen):
    assert pick_fastest(step_s, default="hf float32") == chosen


@pytest.mark.parametrize("rows,max_new_tokens,probe", [
    (32, 8, Shape(32, 2, 8)),
    (4, 200, Shape(4, 2, 32)),
    (512, 16, Shape(64, 2, 16)),
])
def test_probe_shape_caps_rows_and_tokens(rows, max_new_tokens, probe):
    assert probe_shape(rows, max_new_tokens) == probe


def test_timings_use_each_parts_median_and_the_line_shows_both_parts():
    timings = Timings(sample_s={"hf float32": [1.0, 9.0, 1.2], "ct2 int8": [0.5, 0.4, 0.6]},
                      refresh_s={"hf float32": [0.0, 0.0, 0.0], "ct2 int8": [3.0, 2.0, 9.0]})
    step_s = timings.step_s(PROBE, STEP)
    assert step_s == pytest.approx({"hf float32": 4.8, "ct2 int8": 5.0})
    chosen = pick_fastest(step_s, default="hf float32")
    assert chosen == "hf float32"
    line = describe(chosen, timings, PROBE, STEP)
    assert line.startswith("rollout.sampler auto: hf float32 (")
    assert "sampling 32 rows x 8 turns x 8 tokens + one weight refresh" in line
    assert "3 rounds of 32 rows x 2 turns x 8 tokens" in line
    assert line.index("hf float32 4.80 s = 4.80 + 0.00") < line.index(
        "ct2 int8 5.00 s = 2.00 + 3.00")  # cheapest first


def test_time_engines_times_sampling_and_a_real_refresh_each_round():
    """Real tiny HF engines: the learner's own (its refresh only moves the version) and a
    float64 copy (its refresh copies every tensor). The learner changes after the copy is
    built, so the copy holds the learner's weights only if a refresh really ran; each round
    samples and refreshes every candidate, and the last refresh's version stays."""
    model, tokenizer = tiny_model(0)
    model.eval()

    def copy_then_update_the_learner() -> HFCopyEngine:
        engine = HFCopyEngine(model, torch.float64, tokenizer.pad_token_id, seed=0)
        with torch.no_grad():
            model.lm_head.weight.add_(0.01)
        return engine

    builders = {"hf float32": lambda: HFEngine(model, tokenizer.pad_token_id, seed=0),
                "hf float64": copy_then_update_the_learner}
    engines, timings = time_engines(
        builders, lambda engine, version: publish(engine, model, version),
        probe_shape(4, 3), int(model.config.vocab_size), rounds=3)
    assert set(engines) == set(builders)
    for name in builders:
        assert len(timings.sample_s[name]) == 3 and len(timings.refresh_s[name]) == 3
        assert all(t > 0 for t in timings.sample_s[name])
        assert all(t >= 0 for t in timings.refresh_s[name])
        assert engines[name].version == 4  # versions 2, 3, 4 after the warm-up's 1
    copy_state = engines["hf float64"].model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(copy_state[name], tensor.to(torch.float64)), name
