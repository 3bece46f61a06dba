"""Periodic KL-reference resets (trainer/reference.py, ProRL): when they happen, what they
reset, and that a run resumed after one continues with the reset reference."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from turnrl.checkpoint import latest_checkpoint
from turnrl.config import ConfigError, load_config
from turnrl.metrics import read_metrics
from turnrl.trainer import train
from turnrl.trainer.reference import last_reset

TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.progress", "false", "--run.tensorboard", "false", "--run.threads", "1",
        "--eval.episodes", "0", "--optim.lr", "1e-2", "--algo.kl_coef", "0.5"]


def test_the_last_reset_is_the_latest_multiple_of_the_interval():
    assert [last_reset(s, 2) for s in range(6)] == [0, 0, 2, 2, 4, 4]
    assert last_reset(7, 0) == 0  # never reset: the reference is the initial model


def test_a_reset_makes_the_next_steps_kl_zero_and_restarts_the_optimiser(tmp_path):
    cfg = load_config(None, TINY + ["--run.steps", "4", "--algo.reference_reset_every", "2",
                                    "--run.out_dir", str(tmp_path)])
    train(cfg)
    records = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert [s for s, r in records.items() if r.get("update/reference_reset")] == [2, 4]
    # step 3 starts with reference == policy: its KL (measured before the optimiser step) is
    # zero, while step 2's, a step after the policy moved away from the initial model, is not
    assert records[2]["kl"] > 1e-4
    assert records[3]["kl"] == 0.0


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(latest_checkpoint(run_dir) / "model.safetensors")


def test_a_run_resumed_after_a_reset_continues_with_the_reset_reference(tmp_path):
    every = ["--algo.reference_reset_every", "2", "--run.checkpoint_every", "1"]
    whole = load_config(None, TINY + every + ["--run.steps", "4",
                                              "--run.out_dir", str(tmp_path / "whole")])
    train(whole)
    part = load_config(None, TINY + every + ["--run.steps", "3",
                                             "--run.out_dir", str(tmp_path / "part")])
    train(part)
    checkpoint = latest_checkpoint(tmp_path / "part")
    assert (checkpoint / "reference-000002").is_dir()  # the reset's copy travels with it
    moments = torch.load(checkpoint / "optimizer.pt")["state"]
    assert {int(m["step"]) for m in moments.values()} == {1}  # one AdamW step since the reset
    resumed = load_config(None, TINY + every + ["--run.steps", "4",
                                                "--run.out_dir", str(tmp_path / "part")])
    train(resumed, resume=True)
    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "part")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # without the reset the same run ends elsewhere: the reference mattered
    never = load_config(None, TINY + ["--run.checkpoint_every", "1", "--run.steps", "4",
                                      "--run.out_dir", str(tmp_path / "never")])
    train(never)
    c = _weights(tmp_path / "never")
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("extra, says", [
    ([], "algo.kl_coef"),
    (["--algo.kl_coef", "0.1", "--model.lora.r", "4"], "LoRA"),
    (["--algo.kl_coef", "0.1", "--learner.world_size", "2"], "world size 1"),
])
def test_a_reset_that_cannot_work_is_refused_in_one_line(extra, says):
    with pytest.raises(ConfigError, match=says) as info:
        load_config(None, ["--model.name", "tiny", "--algo.reference_reset_every", "2", *extra])
    assert "\n" not in str(info.value)
