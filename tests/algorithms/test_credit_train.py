"""Each turn-level credit method trains end to end on the tiny model; the critic resumes."""

import math

import pytest
import torch

from turnrl.checkpoint import latest_checkpoint, load_component
from turnrl.config import load_config
from turnrl.metrics import read_metrics
from turnrl.trainer import train

TINY_MAZE = ["--model.name", "tiny", "--env.name", "maze", "--env.options", "{size: 2}",
             "--rollout.max_new_tokens", "3", "--rollout.max_turns", "6",
             "--rollout.group_size", "4", "--rollout.groups_per_step", "2",
             "--eval.episodes", "4", "--run.progress", "false", "--run.tensorboard", "false"]


TINY_TWO_TURNS = ["--model.name", "tiny", "--env.name", "say-digit", "--env.options",
                  "{turns: 2}", "--rollout.max_new_tokens", "3", "--optim.lr", "2e-2",
                  "--optim.micro_batch_size", "32", "--eval.episodes", "0",
                  "--run.progress", "false", "--run.tensorboard", "false"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gigpo", "turn_gae"])
def test_turn_level_method_learns_a_two_turn_task_and_saves_its_state(tmp_path, method):
    """Each turn is rewarded for starting with a digit: the method must lift the reward.

    ArCHer is left out on purpose: with its defaults it does not learn this task in 24 steps
    (training reward 0.03 -> 0.02; measured 2026-11-25), a finding for the credit-assignment
    work, checked by the test below only for finite metrics and a saved critic.
    """
    cfg = load_config(None, TINY_TWO_TURNS + ["--algo.advantage", method, "--run.steps", "12",
                                              "--run.checkpoint_every", "6",
                                              "--run.out_dir", str(tmp_path)])
    train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 13))
    first = sum(r["reward/mean"] for r in records[:3]) / 3
    last = sum(r["reward/mean"] for r in records[-3:]) / 3
    assert last > first + 0.3, (method, [round(r["reward/mean"], 2) for r in records])
    for record in records:
        credit = {k: v for k, v in record.items() if k.startswith("credit/")}
        assert credit and all(math.isfinite(v) for v in credit.values())
    saved = load_component(latest_checkpoint(tmp_path), "estimator")
    if method == "gigpo":
        assert not saved  # critic-free
    else:
        assert saved and any(isinstance(v, dict) for v in saved.values())


def test_archer_trains_with_finite_critic_losses_and_saves_its_critic(tmp_path):
    cfg = load_config(None, TINY_TWO_TURNS + ["--algo.advantage", "archer", "--run.steps", "2",
                                              "--run.checkpoint_every", "1",
                                              "--run.out_dir", str(tmp_path)])
    train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert all(math.isfinite(r["credit/q_loss"]) and r["credit/replay_transitions"] > 0
               for r in records)
    saved = load_component(latest_checkpoint(tmp_path), "estimator")
    assert set(saved) >= {"critic", "optimizer", "replay", "generator"}


def test_decoupled_on_policy_update_matches_plain_ppo(tiny):
    """With fresh episodes the proximal policy is the behaviour policy: same step."""
    import copy

    from tests.trainer.test_step import _batch, _grouped_episodes
    from turnrl.config import AlgoConfig, OptimConfig
    from turnrl.trainer.step import UpdateSettings, policy_update, score_policy_tokens

    model, _ = tiny
    batch = _batch(_grouped_episodes())
    with torch.no_grad():  # behaviour log-probs = the current policy's, as on-policy
        logprobs, _ = score_policy_tokens(model, batch, 1.0)
    batch.old_logprobs[:, 1:] = logprobs
    finals, metrics = [], []
    for decoupled in (False, True):
        trained = copy.deepcopy(model)
        settings = UpdateSettings(AlgoConfig(decoupled=decoupled), OptimConfig(), 1.0, 16)
        metrics.append(policy_update(trained, torch.optim.AdamW(trained.parameters(), lr=1e-3),
                                     batch, settings))
        finals.append(torch.cat([p.detach().flatten() for p in trained.parameters()]))
    torch.testing.assert_close(finals[1], finals[0], atol=1e-5, rtol=1e-4)
    assert metrics[1]["offpolicy/ess"] == pytest.approx(1.0, abs=1e-4)
    assert "offpolicy/ess" not in metrics[0]
