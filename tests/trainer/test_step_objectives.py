"""``algo.loss`` gspo / cispo through the real update: plain, decoupled and mismatch-corrected
paths on the tiny model, and a short training run from the command line's config."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.trainer.test_step import _batch, _grouped_episodes
from turnrl.config import AlgoConfig, OptimConfig
from turnrl.trainer.step import UpdateSettings, policy_update

PATHS = {"plain": {}, "decoupled": {"decoupled": True},
         "mismatch": {"mismatch_correction": "tis"}}


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("path", sorted(PATHS))
def test_each_loss_updates_through_each_path(tiny, path):
    """Two epochs on stale-looking episodes, so the ratios leave 1 and the losses differ."""
    model, _ = tiny
    batch = _batch(_grouped_episodes(groups=2, size=4), per_token=True)
    batch.old_logprobs = batch.old_logprobs + 0.5 * batch.loss_mask * torch.randn(
        batch.old_logprobs.shape, generator=torch.Generator().manual_seed(4))
    finals = {}
    for loss in ("ppo", "gspo", "cispo"):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
        settings = UpdateSettings(AlgoConfig(loss=loss, epochs=2, **PATHS[path]), OptimConfig(),
                                  temperature=1.0, agg_constant=16)
        metrics = policy_update(trained, optimizer, batch, settings)
        assert metrics["update/skipped"] == 0.0
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        finals[loss] = _flat(trained)
        assert (finals[loss] - _flat(model)).abs().max() > 1e-4  # it trained
    for loss in ("gspo", "cispo"):  # a different objective took a different step
        assert (finals[loss] - finals["ppo"]).abs().max() > 1e-5


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_a_short_training_run_with_the_loss(tmp_path, loss):
    from turnrl.config import load_config
    from turnrl.metrics import read_metrics
    from turnrl.trainer import train

    args = ["--model.name", "tiny", "--env.name", "say-digit", "--env.options", "{turns: 2}",
            "--rollout.max_new_tokens", "3", "--rollout.group_size", "4",
            "--rollout.groups_per_step", "2", "--run.steps", "2", "--algo.loss", loss,
            "--algo.epochs", "2", "--eval.episodes", "0", "--run.progress", "false",
            "--run.tensorboard", "false", "--run.out_dir", str(tmp_path)]
    cfg = load_config(None, args)
    assert cfg.algo.loss == loss
    train(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss/policy"]) and r["update/skipped"] == 0 for r in rows)
