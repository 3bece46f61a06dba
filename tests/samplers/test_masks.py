"""The HF engine samples each model family exactly or refuses it (turnrl/samplers/masks.py).

Sliding windows (every layer, or per layer type), eager attention's additive masks and rotary
scalings that rescale with length: the engine's log-probs over prompts and multi-turn
continuations longer than the window equal a fresh full forward pass of the model
(transformers' own, which applies the window). Recurrent and other layer kinds are refused
at start-up in one line.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.samplers.test_hf import assert_logprobs_match, recomputed
from tests.trainer.test_prefix import _tiny_of
from turnrl.config.types import ConfigError
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.samplers.masks import MAPPED_MODELS, ONE_MASK_MODELS, sliding_window, unsupported
from turnrl.samplers.onednn import onednn_unusable

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = {"sliding_window": 4}
SLIDING_LAYERS = {"use_sliding_window": True, "max_window_layers": 1, **WINDOW}  # layer 1 slides
FAMILIES = {
    "mistral": WINDOW,
    "mixtral": {**WINDOW, "num_local_experts": 2},
    "phi3": WINDOW,
    "starcoder2": WINDOW,
    "qwen2": SLIDING_LAYERS,
    "qwen3": SLIDING_LAYERS,
    "gemma2": WINDOW,  # eager attention (its default): additive masks, sliding and full layers
    "gemma3_text": {**WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
}
PROMPTS = [[5, 9, 14, 3, 40, 41, 7, 7, 21], [7, 7, 21], [5, 9, 14, 3, 40, 41, 7, 7, 21], [60, 2]]


def family(model_type: str, **extra):
    config = AutoConfig.for_model(model_type, **{**SHAPE, **extra})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def two_turns(engine, params):
    """A call (rows of different lengths, a shared prompt), then one continuing every row
    from its kept keys and values; returns both calls' (prompts, completions)."""
    first = engine.generate(PROMPTS, params)
    longer = [p + c.token_ids + [11, 12, 13] for p, c in zip(PROMPTS, first, strict=True)]
    return [(PROMPTS, first), (longer, engine.generate(longer, params))]


def largest_drift(model, calls):
    return max(float((recomputed(model, p, c, 1.0) - torch.tensor(c.logprobs)).abs().max())
               for prompts, out in calls for p, c in zip(prompts, out, strict=True))


def test_every_family_with_a_window_is_checked_here():
    assert set(FAMILIES) == ONE_MASK_MODELS | MAPPED_MODELS


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_windowed_models_sample_what_a_fresh_pass_scores(model_type):
    model = family(model_type, **FAMILIES[model_type])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the window is applied: nothing to warn about
        engine = HFEngine(model, 0, seed=3)
    assert engine.masks.window == 4
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    calls = two_turns(engine, params)
    for prompts, completions in calls:
        assert_logprobs_match(model, prompts, completions, 1.0)
    # The window matters in these models: without it the same engine drifts (as it did).
    unwindowed = HFEngine(model, 0, seed=3)
    unwindowed.masks = dataclasses.replace(engine.masks, window=None)
    assert largest_drift(model, two_turns(unwindowed, params)) > 1e-3


@pytest.mark.skipif(onednn_unusable(torch.nn.Linear(2, 2)) is not None,
                    reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_the_packed_tree_applies_the_window_too(model_type):
    model = family(model_type, **FAMILIES[model_type])
    engine = HFEngine(model, 0, seed=3, matmul="onednn")
    assert "PackedLinear tree" in engine.describe()
    for prompts, completions in two_turns(engine, SamplingParams(6, 1.0)):
        assert_logprobs_match(model, prompts, completions, 1.0)


def test_eager_attention_gets_an_additive_mask():
    """Eager attention adds its mask to the scores: a boolean one added 1s and 0s and let
    padding through. Left-padded rows and kept pasts now score as a fresh pass."""
    model = _tiny_of("llama", "eager")
    engine = HFEngine(model, 0, seed=3)
    assert engine.masks.additive == torch.float32 and engine.masks.window is None
    for prompts, completions in two_turns(engine, SamplingParams(6, 1.0)):
        assert_logprobs_match(model, prompts, completions, 1.0)
    engine.masks = dataclasses.replace(engine.masks, additive=None)  # booleans, as before
    assert largest_drift(model, two_turns(engine, SamplingParams(6, 1.0))) > 1e-2


def test_a_window_of_an_unchecked_model_type_is_still_named_at_start_up():
    config = AutoConfig.for_model("cohere2", **SHAPE, **WINDOW)
    with pytest.warns(UserWarning, match="4-token sliding window.*model type 'cohere2'"):
        assert sliding_window(config) == (None, False)
    for quiet in (AutoConfig.for_model("mistral", **SHAPE, sliding_window=None),
                  AutoConfig.for_model("qwen2", **SHAPE)):  # no layer slides
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert sliding_window(quiet) == (None, False)


ROPES = {
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0,
                 "short_factor": [1.0 + i / 8 for i in range(8)],
                 "long_factor": [2.0 + i for i in range(8)],
                 "original_max_position_embeddings": 24},
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_a_rotary_scaling_that_rescales_is_exact_below_its_range_and_refused_past_it(kind):
    model = family("llama", max_position_embeddings=24 if kind == "dynamic" else 96,
                   rope_parameters=ROPES[kind])
    with torch.no_grad():  # sharper attention, so positions (and their frequencies) matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    engine = HFEngine(model, 0, seed=3)
    assert engine.masks.rope == (kind, 24)
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    for prompts, completions in two_turns(engine, params):  # rows of at most 23 tokens
        assert_logprobs_match(model, prompts, completions, 1.0)
    long = [list(range(3, 23))]  # 20 tokens + 5 new: past 24
    with pytest.raises(ConfigError) as refused:
        engine.generate(long, params)
    message = str(refused.value)
    assert f"{kind!r} rotary scaling" in message and "past 24" in message
    assert "rollout.sampler vllm" in message and "\n" not in message
    # What the refusal prevents: kept keys from short calls, rotated at other frequencies.
    engine.masks = dataclasses.replace(engine.masks, rope=None)
    first = engine.generate(long, SamplingParams(2, 1.0))
    longer = long[0] + first[0].token_ids + list(range(30, 70))
    assert largest_drift(model, [([longer], engine.generate([longer], params))]) > 1e-3


def test_recurrent_hybrids_are_refused_at_start_up():
    """Qwen3.5's gated delta-net layers keep a recurrent state the per-row key/value cache
    cannot carry: a tiny one is built on CPU and refused in one line naming the type."""
    config = AutoConfig.for_model(
        "qwen3_5_text", **SHAPE, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ConfigError) as refused:
        HFEngine(model, 0)
    message = str(refused.value)
    assert message.startswith("HF sampler: model type 'qwen3_5_text' has recurrent layers "
                              "(linear_attention)")
    assert "rollout.sampler vllm" in message and "\n" not in message


@pytest.mark.parametrize(("model_type", "extra", "named"), [
    ("qwen3_next", {}, "recurrent layers (linear_attention)"),
    ("mamba", {}, "recurrent layers (linear_attention)"),
    ("jamba", {}, "recurrent layers (linear_attention)"),
    ("falcon_h1", {}, "recurrent layers (hybrid)"),
    ("lfm2", {"layer_types": ["conv", "full_attention"]}, "recurrent layers (conv)"),
    ("llama4_text", {}, "layers of kind chunked_attention"),
])
def test_other_layer_kinds_are_refused_from_the_config(model_type, extra, named):
    config = AutoConfig.for_model(model_type, num_hidden_layers=2, **extra)
    assert named in unsupported(config.get_text_config())


def test_attention_only_models_are_accepted():
    for model_type in ("llama", "qwen3", "gemma2", "mistral"):
        assert unsupported(AutoConfig.for_model(model_type, **SHAPE)) is None
