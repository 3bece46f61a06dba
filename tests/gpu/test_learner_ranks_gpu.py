"""Learner ranks over NCCL, one GPU per rank: skipped without two CUDA GPUs. NOT RUN on GPUs:
the development machine has none (tests/trainer/test_ranks.py and test_ranks_train.py run the
same code over gloo on CPUs in ``make test``).

``turnrl train --learner.world_size 2`` on the tiny model with ``--model.device cuda``
(``learner.backend auto`` picks NCCL): it trains, writes a sharded checkpoint, and a resume at
world size 1 continues it; the 2-rank update equals one process's within 1e-4 (TF32 and
NCCL's summation order allowed for).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs (NCCL: one rank per GPU)", allow_module_level=True)

from tests.trainer.test_ranks import max_difference, one_process, play, tiny_config  # noqa: E402


def test_two_gpu_ranks_train_and_resume_at_one(tmp_path):
    run = tmp_path / "run"
    args = ["--model.name", "tiny", "--model.device", "cuda", "--run.steps", "2",
            "--run.progress", "false", "--eval.episodes", "4", "--run.out_dir", str(run)]
    done = subprocess.run([sys.executable, "-m", "turnrl", "train", *args,
                           "--learner.world_size", "2"], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "checkpoints" / "step-000002" / ".metadata").is_file()
    resumed = subprocess.run([sys.executable, "-m", "turnrl", "train", "--run.out_dir",
                              str(run), "--resume", "--run.steps", "3",
                              "--learner.world_size", "1"], capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]


def test_nccl_update_equals_one_process(tmp_path):
    from tests.trainer.test_ranks import ranks

    cfg = tiny_config(tmp_path, "--model.device", "cuda")
    batches = play(cfg, steps=1)
    cfg = replace(cfg, learner=replace(cfg.learner, backend="nccl", timeout_s=300))
    got = ranks(cfg, batches, 2, tmp_path)
    assert max_difference(got["state"], one_process(cfg, batches)) < 1e-4
