"""GPU checks: skipped on machines without CUDA (the development machine has none; run them
with `make test-gpu` on a GPU host). They passed on an H100 on 2026-11-27 (docs/gpu.md)."""

import pytest
import torch

from turnrl.algorithms.losses import token_logprobs
from turnrl.config import load_config
from turnrl.models import tiny_model
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.trainer import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_engine_logprobs_match_forward_on_gpu():
    model, tok = tiny_model(seed=0)
    model.to("cuda")
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    prompt = tok("Say a digit.")["input_ids"]
    [completion] = engine.generate([prompt], SamplingParams(max_new_tokens=5))
    ids = torch.tensor([prompt + completion.token_ids], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    recomputed = token_logprobs(logits, ids[:, 1:])[0, len(prompt) - 1:].cpu()
    assert torch.allclose(recomputed, torch.tensor(completion.logprobs), atol=1e-3)


def test_training_runs_on_gpu(tmp_path):
    cfg = load_config(None, ["--model.name", "tiny", "--model.device", "cuda",
                             "--env.name", "guess-number", "--run.steps", "3",
                             "--eval.episodes", "8", "--run.out_dir", str(tmp_path),
                             "--run.progress", "false"])
    result = train(cfg)
    assert result.after is not None and result.after.episodes == 8


def test_engine_paths_all_run_on_gpu():
    """Shared prompts, a second call continuing kept rows, and a long fresh prompt prefilled in
    its own bucket and merged: every path that builds masks or indices runs on CUDA (the
    causal mask was once made on the CPU and crashed the first CUDA prefill)."""
    model, tok = tiny_model(seed=0)
    model.to("cuda")
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    params = SamplingParams(max_new_tokens=4, temperature=0.7)
    prompts = [tok("Say a digit.")["input_ids"]] * 2 + [tok("Hi")["input_ids"]]
    first = engine.generate(prompts, params)
    follow = [p + c.token_ids + tok(" ok?")["input_ids"]
              for p, c in zip(prompts, first, strict=True)]
    follow.append(tok("A much longer fresh prompt " * 30)["input_ids"])
    second = engine.generate(follow, params)
    for prompt, completion in zip(follow, second, strict=True):
        ids = torch.tensor([prompt + completion.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1]
        expected = token_logprobs(logits, ids[:, 1:], 0.7)[0, len(prompt) - 1:].cpu()
        assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=1e-3)
