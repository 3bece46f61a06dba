"""Exploration options inside the real update and the real sync trainer (tiny HF model)."""

from __future__ import annotations

import torch

from tests.trainer.test_train import (
    _batch,  # a batch with a padded row, old logprobs of the tiny model
)
from turnrl.algorithms.exploration import entropy_threshold
from turnrl.checkpoint import latest_checkpoint, load_component
from turnrl.config import load_config
from turnrl.metrics import read_metrics
from turnrl.trainer import UpdateSettings, policy_update, train
from turnrl.trainer.step import score_policy_tokens
from turnrl.types import Batch

TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.tensorboard", "false", "--eval.episodes", "0", "--optim.micro_batch_size", "32"]


def _grad(model, batch, settings):
    policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, settings)
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_top_entropy_training_uses_one_batch_threshold_across_micro_batches(tiny):
    model, _ = tiny
    batch = _batch(tiny)
    cfg = load_config(None, ["--optim.max_grad_norm", "0"])
    grads, metrics = [], []
    for micro in (6, 2):
        optim = cfg.optim.__class__(micro_batch_size=micro, max_grad_norm=0)
        settings = UpdateSettings(cfg.algo, optim, 1.0, 12, top_entropy_fraction=0.25)
        grads.append(_grad(model, batch, settings))
        metrics.append(policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch,
                                     settings))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)  # accumulation stays exact
    kept = metrics[0]["explore/trained_token_fraction"]
    assert 0.25 <= kept < 0.3 and metrics[1]["explore/trained_token_fraction"] == kept
    full = _grad(model, batch, UpdateSettings(cfg.algo, cfg.optim.__class__(max_grad_norm=0),
                                              1.0, 12))
    assert not torch.allclose(full, grads[0], atol=1e-6)  # the mask did change the gradient

    # The kept tokens' gradient equals the full loss restricted to them by the loss mask,
    # scaled by (all tokens / kept tokens): Wang et al. keep the all-token normaliser.
    with torch.no_grad():
        _, entropy = score_policy_tokens(model, batch, 1.0, entropy=True)
    policy = batch.loss_mask[:, 1:].bool()
    keep = policy & (entropy >= entropy_threshold(entropy[policy], 0.25))
    restricted = Batch(batch.input_ids, batch.attention_mask,
                       torch.cat([batch.loss_mask[:, :1], keep.float()], 1), batch.old_logprobs,
                       batch.advantages)
    only = _grad(model, restricted, UpdateSettings(cfg.algo,
                                                   cfg.optim.__class__(max_grad_norm=0), 1.0, 12))
    scale = float(keep.sum()) / float(policy.sum())
    assert torch.allclose(grads[0], only * scale, atol=1e-6)


def test_gradient_norm_clipping_is_on_by_default(tiny):
    model, _ = tiny
    batch = _batch(tiny)
    batch = Batch(batch.input_ids, batch.attention_mask, batch.loss_mask, batch.old_logprobs,
                  batch.advantages * 1e4)  # a huge gradient
    cfg = load_config(None, [])
    assert cfg.optim.max_grad_norm == 1.0
    metrics = policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch,
                            UpdateSettings(cfg.algo, cfg.optim, 1.0, 12))
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert metrics["grad_norm"] > 10 and float(clipped) <= 1.0 + 1e-4


def test_a_run_made_to_collapse_raises_the_entropy_warning(tmp_path, capsys):
    cfg = load_config(None, TINY + ["--optim.lr", "5e-2", "--run.steps", "8",
                                    "--explore.warn_patience", "2",
                                    "--run.out_dir", str(tmp_path / "collapse")])
    train(cfg)
    records = read_metrics(tmp_path / "collapse")
    flags = [r["warn/entropy_collapse"] for r in records]
    assert flags[0] == 0 and flags[-1] == 1  # fires once entropy fell below 10% of the start
    assert records[-1]["entropy"] < 0.1 * records[0]["entropy"]
    assert "WARN=entropy_collapse" in capsys.readouterr().out  # the progress line says so
    # A gentle run does not warn.
    calm = load_config(None, TINY + ["--optim.lr", "1e-4", "--run.steps", "3",
                                     "--run.out_dir", str(tmp_path / "calm")])
    train(calm)
    assert not any(r["warn/entropy_collapse"] or r["warn/clip_extreme"]
                   for r in read_metrics(tmp_path / "calm"))


def test_every_option_at_once_trains_checkpoints_and_resumes(tmp_path):
    options = ["--explore.dynamic_sampling", "true", "--explore.overlong_buffer", "2",
               "--explore.mask_truncated", "true", "--explore.top_entropy_fraction", "0.5",
               "--explore.entropy_target", "8.0", "--explore.temperature_schedule", "linear",
               "--explore.temperature_end", "0.7", "--explore.positive_weight", "1.5",
               "--explore.negative_weight", "0.5", "--explore.pass_k", "4",
               "--explore.novelty_coef", "0.1", "--rollout.group_size", "4",
               "--run.checkpoint_every", "2", "--optim.lr", "1e-3",
               "--run.out_dir", str(tmp_path)]
    train(load_config(None, TINY + options + ["--run.steps", "2"]))
    state = load_component(latest_checkpoint(tmp_path), "exploration")
    assert state["step"] == 2 and state["novelty"]["counts"]
    train(load_config(None, TINY + options + ["--run.steps", "3"]), resume=True)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    # The schedule resumed at its step (over the new run.steps: step 3 of 3 is the end).
    temperatures = [r["explore/temperature"] for r in records]
    assert temperatures[0] == 1.0 and temperatures[-1] == 0.7
    for key in ("dynamic/kept_groups", "explore/novelty_bonus", "explore/overlong_penalty",
                "explore/truncated_masked", "explore/entropy_coef",
                "explore/trained_token_fraction", "warn/entropy_collapse"):
        assert all(key in r for r in records), key
    assert records[1]["explore/entropy_coef"] > 0  # entropy below 8 nats raised the bonus


def test_exploration_benchmark_quick(tmp_path, capsys):
    import json

    import exploration

    assert exploration.main(["--quick", "--out", str(tmp_path), "--jobs", "1",
                             "--methods", "grpo,dapo"]) == 0
    out = capsys.readouterr().out
    assert "ratio: best option (dapo) / grpo pass@8 = " in out.splitlines()[-1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {"grpo", "dapo"}
    assert all(0 <= s["pass@1"] <= s["pass@8"] <= 1 for s in summary.values())
    # Dynamic sampling collects at least the plain batch, more when groups were dropped.
    assert summary["dapo"]["episodes"] >= summary["grpo"]["episodes"]
