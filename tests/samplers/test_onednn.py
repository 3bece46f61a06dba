"""oneDNN's packed products for CPU decoding (``sampler.matmul``, turnrl/samplers/onednn.py):
the same products as torch's within float rounding, the learner's modules untouched and its
tensors shared, repacked after every new version (fused AdamW included, which does not bump
tensors' version counters), LoRA and the bf16 copy engine served, bad requests refused."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from tests.samplers.test_hf import assert_logprobs_match, recomputed
from turnrl.config import ConfigError, load_config
from turnrl.config.precision import cpu_has_bf16
from turnrl.models import tiny_model
from turnrl.policy import load_policy
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.samplers.copy import HFCopyEngine
from turnrl.samplers.lean import LeanDecoder
from turnrl.samplers.onednn import (
    PackedLinear,
    linear_weight_bytes,
    onednn_unusable,
    packed_decoder,
    resolve_matmul,
)

pytestmark = pytest.mark.skipif(onednn_unusable(torch.nn.Linear(2, 2)) is not None,
                                reason="this torch build has no oneDNN linear")
TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.progress", "false", "--run.tensorboard", "false"]
PROMPTS = [[5, 9, 14, 3], [7, 7, 21], [5, 9, 14, 3]]


def test_a_packed_product_is_torchs_within_rounding_and_keeps_autograd():
    torch.manual_seed(0)
    for bias in (True, False):
        linear = torch.nn.Linear(40, 24, bias=bias)
        packed = PackedLinear(linear)
        x = torch.randn(2, 5, 40)
        with torch.no_grad():
            assert torch.allclose(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    needs_grad = torch.randn(3, 40, requires_grad=True)
    assert packed(needs_grad).grad_fn is not None  # torch's linear where a gradient is wanted
    with torch.no_grad():
        assert packed(torch.randn(0, 40)).shape == (0, 24)  # an empty batch


def test_the_largest_cache_is_read_from_sysfs_files(tmp_path):
    from turnrl.samplers.onednn import last_level_cache_bytes

    for index, size in enumerate(["48K", "2048K", "32M\n", "garbage"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size)
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    assert last_level_cache_bytes(tmp_path / "missing") is None  # auto then ignores the cache


def test_the_decoder_shares_the_learners_tensors_and_leaves_its_modules_alone():
    model, _ = tiny_model(seed=0)
    decoder = packed_decoder(model)
    learner_tensors = {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert {id(t) for t in [*decoder.parameters(), *decoder.buffers()]} == learner_tensors
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in decoder.modules()) == sum(
        type(m) is torch.nn.Linear for m in model.modules())
    assert linear_weight_bytes(model) > 0


def _onednn_engine(model, pad_token_id, decoder: str, seed: int = 0) -> HFEngine:
    """An onednn engine on the lean pass (what the tiny llama gets) or forced onto the tree
    (what LoRA and other model types get)."""
    engine = HFEngine(model, pad_token_id, seed=seed, matmul="onednn")
    assert isinstance(engine.decoder, LeanDecoder)
    if decoder == "tree":
        engine.decoder = packed_decoder(model)
    return engine


@pytest.mark.parametrize("decoder", ["lean", "tree"])
def test_onednn_engine_reports_the_models_logprobs_and_samples_as_torch_does(decoder):
    model, tok = tiny_model(seed=0)
    params = SamplingParams(max_new_tokens=6, temperature=0.7)
    fast = _onednn_engine(model, tok.pad_token_id, decoder, seed=3)
    completions = fast.generate(PROMPTS, params)
    assert_logprobs_match(model, PROMPTS, completions, 0.7)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    plain = HFEngine(model, tok.pad_token_id, seed=3)
    assert [c.token_ids for c in fast.generate(PROMPTS, greedy)] == \
        [c.token_ids for c in plain.generate(PROMPTS, greedy)]
    again = _onednn_engine(model, tok.pad_token_id, decoder, seed=3).generate(PROMPTS, params)
    assert [(c.token_ids, c.logprobs) for c in again] == \
        [(c.token_ids, c.logprobs) for c in completions]  # deterministic run to run


@pytest.mark.parametrize("decoder", ["lean", "tree"])
def test_a_new_version_repacks_after_a_fused_adamw_step(decoder):
    """Fused AdamW writes the weights without bumping their version counters, so the packed
    copies are stale until ``version`` is set (what ``publish`` does)."""
    model, tok = tiny_model(seed=0)
    engine = _onednn_engine(model, tok.pad_token_id, decoder)
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    engine.generate(PROMPTS, params)  # packs the weights
    ids = torch.tensor([PROMPTS[0] + [11, 12]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for _ in range(3):
        loss = -functional.log_softmax(model(input_ids=ids).logits[0, -1], -1)[11]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with pytest.raises(AssertionError):  # stale until the version is set: the test can fail
        assert_logprobs_match(model, PROMPTS, engine.generate(PROMPTS, params), 1.0)
    engine.load(None, 1)  # what publish does after every update
    completions = engine.generate(PROMPTS, params)
    assert_logprobs_match(model, PROMPTS, completions, 1.0)  # the new weights, not the old


def test_lora_policy_samples_through_packed_products_with_its_adapter():
    pytest.importorskip("peft")
    cfg = load_config(None, TINY + ["--model.lora.r", "4", "--sampler.matmul", "onednn"])
    policy = load_policy(cfg)
    assert policy.engine.matmul == "onednn"
    with torch.no_grad():  # a non-zero adapter, so a sampler without it would disagree
        for name, tensor in policy.model.named_parameters():
            if "lora_B" in name:
                tensor.normal_(0, 0.5)
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    policy.engine.generate(PROMPTS, params)
    layers = [m for m in policy.engine.decoder.modules() if isinstance(m, PackedLinear)]
    before = {id(m): m.packed[1] for m in layers}
    with torch.no_grad():  # an update: the adapter changes, the base stays
        for name, tensor in policy.model.named_parameters():
            if "lora_B" in name:
                tensor.mul_(2)
    policy.engine.load(None, 2)
    completions = policy.engine.generate(PROMPTS, params)
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        expected = recomputed(policy.model, prompt, completion, 1.0)
        assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=1e-4)
    kept = [before[id(m)] is m.packed[1] for m in layers]
    frozen = [not m.linear.weight.requires_grad for m in layers]
    assert kept == frozen and any(frozen) and not all(frozen)  # the base packed once


@pytest.mark.skipif(not cpu_has_bf16(), reason="the bf16 copy engine needs native bf16")
def test_bf16_copy_engine_packs_its_copy_and_repacks_after_a_refresh():
    model, tok = tiny_model(seed=0)
    engine = HFCopyEngine(model, torch.bfloat16, tok.pad_token_id, seed=0, matmul="onednn")
    assert engine.matmul == "onednn"
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    engine.generate(PROMPTS, params)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.mul_(1.5)
    engine.load(model.state_dict(), 1)
    completions = engine.generate(PROMPTS, params)
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        expected = recomputed(engine.model, prompt, completion, 1.0).float()
        assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=0.05)


def test_requests_resolve_or_fail_in_one_line(monkeypatch):
    from turnrl.samplers import onednn

    model, _ = tiny_model(seed=0)
    assert resolve_matmul("torch", model) == "torch"
    weights = linear_weight_bytes(model)  # 0.6 MB
    monkeypatch.setattr(onednn, "last_level_cache_bytes", lambda: weights + 1)
    assert resolve_matmul("auto", model) == "torch"  # weights in cache: not read-bound
    monkeypatch.setattr(onednn, "last_level_cache_bytes", lambda: weights - 1)
    assert resolve_matmul("auto", model) == "onednn"  # float32 on a CPU with oneDNN
    monkeypatch.setattr(onednn, "available_memory_bytes", lambda: weights)
    assert resolve_matmul("auto", model) == "torch"  # no room for the packed copy
    assert resolve_matmul("auto", model.half()) == "torch"
    with pytest.raises(ConfigError, match="float16.*--sampler.matmul torch"):
        resolve_matmul("onednn", model)
    with pytest.raises(ConfigError, match="sampler.matmul"):
        load_config(None, TINY + ["--sampler.matmul", "mkl"])
    engine = load_policy(load_config(None, TINY + ["--sampler.matmul", "torch"])).engine
    assert engine.matmul == "torch" and engine.decoder is engine.model
