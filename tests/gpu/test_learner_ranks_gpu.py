"""Learner ranks on CUDA GPUs. NEVER RUN ON A GPU: the development machine has none, and no
GPU machine was lent while these were written; each test skips without the GPUs it names.
tests/trainer/test_ranks.py and test_ranks_train.py run the same code over gloo on CPUs in
``make test`` (world sizes 1, 2 and 3).

Two GPUs (NCCL, one rank per GPU): ``turnrl train --learner.world_size 2`` on the tiny model
with ``--model.device cuda`` (``learner.backend auto`` picks NCCL) trains, writes a sharded
checkpoint, and a resume at world size 1 continues it; the 2-rank update equals one process's
within 1e-4 (TF32 and NCCL's summation order allowed for).

One GPU (a lent H100 can run these): FSDP2 at world size 1, which fsdp's own options ask for
(``learner.param_dtype``, ``reduce_dtype``, ``cpu_offload``: ``LearnerConfig.ranked``): one
NCCL rank's update equals one process's within 1e-4, and ``turnrl train`` with bf16 weights and
CPU offload trains 2 steps and writes a DCP checkpoint.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from tests.trainer.test_ranks import max_difference, one_process, play, ranks, tiny_config

one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="needs two CUDA GPUs (NCCL: one rank per GPU)")
TRAIN = ["--model.name", "tiny", "--model.device", "cuda", "--run.steps", "2",
         "--run.progress", "false", "--eval.episodes", "4"]


def turnrl_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "turnrl", "train", *args],
                          capture_output=True, text=True, timeout=900)


@two_gpus
def test_two_gpu_ranks_train_and_resume_at_one(tmp_path):
    run = tmp_path / "run"
    done = turnrl_train(*TRAIN, "--run.out_dir", str(run), "--learner.world_size", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "checkpoints" / "step-000002" / ".metadata").is_file()
    resumed = turnrl_train("--run.out_dir", str(run), "--resume", "--run.steps", "3",
                           "--learner.world_size", "1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]


@two_gpus
def test_nccl_update_equals_one_process(tmp_path):
    cfg = tiny_config(tmp_path, "--model.device", "cuda")
    batches = play(cfg, steps=1)
    cfg = replace(cfg, learner=replace(cfg.learner, backend="nccl", timeout_s=300))
    got = ranks(cfg, batches, 2, tmp_path)
    assert max_difference(got["state"], one_process(cfg, batches)) < 1e-4


@one_gpu
def test_fsdp_at_world_size_one_on_a_gpu_equals_one_process(tmp_path):
    cfg = tiny_config(tmp_path, "--model.device", "cuda", "--learner.reduce_dtype", "float32")
    assert cfg.learner.ranked() and cfg.learner.world_size == 1
    batches = play(cfg, steps=1)
    cfg = replace(cfg, learner=replace(cfg.learner, strategy="fsdp", backend="nccl",
                                       timeout_s=300))
    got = ranks(cfg, batches, 1, tmp_path)
    one = one_process(cfg, batches)
    assert max_difference(one, one_process(cfg, [])) > 1e-5  # the update moved the weights
    assert max_difference(got["state"], one) < 1e-4


@one_gpu
def test_fsdp_at_world_size_one_with_bf16_and_cpu_offload_trains(tmp_path):
    run = tmp_path / "run"
    done = turnrl_train(*TRAIN, "--run.out_dir", str(run), "--learner.param_dtype",
                        "bfloat16", "--learner.reduce_dtype", "float32",
                        "--learner.cpu_offload", "true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "checkpoints" / "step-000002" / ".metadata").is_file()  # sharded: FSDP2
