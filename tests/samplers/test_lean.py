"""The lean sampling pass (turnrl/samplers/lean.py) samples what transformers' pass samples:
each Llama-shaped model type, grouped-query attention, biases, q/k norms and scaled rotary
embeddings, sliding windows, multi-turn calls that continue kept keys and values, refreshed biases and
unfrozen weights (fused AdamW's refresh, lean and tree alike: tests/samplers/test_onednn.py); models it
cannot run and a wrong formula fall back to the PackedLinear tree."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional
from transformers import AutoConfig, AutoModelForCausalLM

from tests.samplers.test_hf import assert_logprobs_match
from tests.trainer.test_prefix import _tiny_of
from turnrl.config.precision import cpu_has_bf16
from turnrl.models import tiny_model
from turnrl.samplers import HFEngine, SamplingParams, lean
from turnrl.samplers.copy import HFCopyEngine
from turnrl.samplers.lean import LeanDecoder, lean_unusable, onednn_decoder, self_check
from turnrl.samplers.onednn import PackedLinear, onednn_unusable

pytestmark = pytest.mark.skipif(onednn_unusable(torch.nn.Linear(2, 2)) is not None,
                                reason="this torch build has no oneDNN linear")
PROMPTS = [[5, 9, 14, 3, 40, 41], [7, 7, 21], [5, 9, 14, 3, 40, 41], [60, 2]]


def _variant(model_type: str, **extra):
    """``_tiny_of``'s shape (4 heads on 2 key/value heads) with config overrides."""
    shape = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=256)
    config = AutoConfig.for_model(model_type, **{**shape, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-zero biases and norm weights, so a dropped one shows
        for name, tensor in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                tensor.add_(torch.randn_like(tensor) * 0.3)
    return model


MODELS = {
    "llama": lambda: _tiny_of("llama", "sdpa"),
    "mistral": lambda: _tiny_of("mistral", "sdpa"),
    "qwen2 (q/k/v biases)": lambda: _variant("qwen2"),
    "qwen3 (q/k norms)": lambda: _variant("qwen3"),
    "mistral (sliding window 4)": lambda: _variant("mistral", sliding_window=4),
    "qwen2 (layer 1 slides, window 4)": lambda: _variant(
        "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "llama (all biases, llama3 rotary scaling)": lambda: _variant(
        "llama", attention_bias=True, mlp_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


def _two_turns(engine, params):
    """A call, then one that continues each row (prompt + reply + new tokens) from its kept
    keys and values, with rows of different lengths in one batch."""
    first = engine.generate(PROMPTS, params)
    longer = [p + c.token_ids + [11, 12] for p, c in zip(PROMPTS, first, strict=True)]
    return first, longer, engine.generate(longer, params)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_lean_pass_samples_what_transformers_pass_samples(name):
    model = MODELS[name]()
    assert lean_unusable(model) is None
    fast = HFEngine(model, 0, seed=3, matmul="onednn")
    assert isinstance(fast.decoder, LeanDecoder)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    plain = HFEngine(model, 0, seed=3)
    assert [c.token_ids for c in _two_turns(fast, greedy)[2]] == \
        [c.token_ids for c in _two_turns(plain, greedy)[2]]
    params = SamplingParams(max_new_tokens=6, temperature=0.7)
    first, longer, second = _two_turns(fast, params)
    assert_logprobs_match(model, PROMPTS, first, 0.7)
    assert_logprobs_match(model, longer, second, 0.7)  # continued from the kept cache


def test_biases_and_weights_unfrozen_after_start_up_are_refreshed_too():
    """The review's cases: the copies of the biases follow them, and a tensor that takes a
    gradient only after the engine was built is still dropped on a new version. Each stale
    sampler is shown to fail the check first (a saturated model would pass anything)."""
    model = _variant("qwen2")  # q/k/v biases
    model.requires_grad_(False)
    engine = HFEngine(model, 0, seed=0, matmul="onednn")
    assert isinstance(engine.decoder, LeanDecoder)
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    engine.generate(PROMPTS, params)  # packs the weights and copies the biases
    with torch.no_grad():  # only a bias moves, in place (its version counter moves)
        model.model.layers[0].self_attn.v_proj.bias.add_(5.0)
    assert_logprobs_match(model, PROMPTS, engine.generate(PROMPTS, params), 1.0)
    model.requires_grad_(True)
    ids = torch.tensor([PROMPTS[0] + [11, 12]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    loss = -functional.log_softmax(model(input_ids=ids).logits[0, -1], -1)[11]
    loss.backward()
    optimizer.step()
    with pytest.raises(AssertionError):
        assert_logprobs_match(model, PROMPTS, engine.generate(PROMPTS, params), 1.0)
    engine.load(None, 1)
    assert_logprobs_match(model, PROMPTS, engine.generate(PROMPTS, params), 1.0)


def test_sampling_leaves_the_learners_module_modes_alone():
    model = _tiny_of("llama", "sdpa").eval()
    engine = HFEngine(model, 0, seed=0, matmul="onednn")
    assert isinstance(engine.decoder, LeanDecoder)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, temperature=1.0))
    assert not any(m.training for m in model.modules())
    model.train()
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, temperature=1.0))
    assert all(m.training for m in model.modules())


@pytest.mark.skipif(not cpu_has_bf16(), reason="the bf16 copy engine needs native bf16")
def test_the_bf16_copy_engine_samples_through_the_lean_pass():
    model, tok = tiny_model(seed=0)
    engine = HFCopyEngine(model, torch.bfloat16, tok.pad_token_id, seed=0, matmul="onednn")
    assert isinstance(engine.decoder, LeanDecoder)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    copy = engine.model  # the bf16 copy: the lean pass matches its own plain pass
    plain = HFEngine(copy, tok.pad_token_id, seed=0)
    assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == \
        [c.token_ids for c in plain.generate(PROMPTS, greedy)]


def test_models_the_lean_pass_cannot_run_keep_the_packed_tree():
    gemma = _tiny_of("gemma", "sdpa")
    assert "gemma" in lean_unusable(gemma)
    decoder, named = onednn_decoder(gemma)
    assert not isinstance(decoder, LeanDecoder)
    assert named.startswith("PackedLinear tree; no lean pass: model type 'gemma'")
    model = _tiny_of("llama", "sdpa")
    model.model.layers[1].mlp.up_proj = PackedLinear(model.model.layers[1].mlp.up_proj)
    assert "nn.Linear" in lean_unusable(model)  # a wrapped projection (LoRA is one)
    decoder, named = onednn_decoder(model)
    assert "nn.Linear" in named
    assert any(isinstance(m, PackedLinear) for m in decoder.modules())
    mixed = _variant("qwen2")  # q/k/v concatenate: a bias on some of them only cannot
    mixed.model.layers[0].self_attn.k_proj.bias = None
    assert "bias" in lean_unusable(mixed)
    assert not isinstance(onednn_decoder(mixed)[0], LeanDecoder)


def test_a_model_that_breaks_the_lean_pass_falls_back_instead_of_failing():
    """More layers than ``num_hidden_layers`` (transformers runs the first ones only) and a
    lean pass that raises: the engine still starts, on the tree."""
    model = _variant("llama", num_hidden_layers=3)
    model.config.num_hidden_layers = 2
    assert isinstance(HFEngine(model, 0, matmul="onednn").decoder, LeanDecoder)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    assert [c.token_ids for c in HFEngine(model, 0, matmul="onednn").generate(PROMPTS, greedy)] \
        == [c.token_ids for c in HFEngine(model, 0).generate(PROMPTS, greedy)]
    broken = _tiny_of("llama", "sdpa")
    broken.model.layers[0].self_attn.q_proj.weight = torch.nn.Parameter(torch.zeros(3, 3))
    decoder, named = onednn_decoder(broken)  # the fallback says why, on one line
    assert not isinstance(decoder, LeanDecoder)
    assert "the lean pass raised" in named and "\n" not in named and len(named) < 200
    engine = HFEngine(broken, 0, matmul="onednn")
    assert engine.describe() == f"hf float32 on cpu ({named})"


def test_the_self_check_turns_a_wrong_formula_away(monkeypatch):
    model = _tiny_of("llama", "sdpa")
    assert self_check(model, LeanDecoder(model)) is None
    monkeypatch.setattr(lean, "_rotate_half", lambda x: x)  # a rotary embedding gone wrong
    assert "differ" in self_check(model, LeanDecoder(model))
    decoder, named = onednn_decoder(model)
    assert not isinstance(decoder, LeanDecoder)
    assert "differ" in named
