"""A reward model in the loop: rewards combined by weight with turns kept consistent, a
tiny run that trains on them and logs ``reward/model_*``, a bad model refused before any
step."""

from __future__ import annotations

import pytest

from tests.rewards.test_model import save_rm
from turnrl.config import load_config
from turnrl.launch import train
from turnrl.metrics import read_metrics
from turnrl.rewards.model import RewardModelError
from turnrl.trainer.reward_model import set_reward
from turnrl.types import Episode, Turn


def test_set_reward_weights_env_and_model_and_keeps_turns_summing_to_the_return():
    ep = Episode("e", 0, 0, turns=[Turn(0, 1, "a", "o", 1.0), Turn(1, 2, "b", "o", 2.0)],
                 reward=3.0)
    set_reward(ep, 0.5, 0.75)
    assert ep.reward == pytest.approx(0.5 * 3.0 + 0.75)
    assert [t.reward for t in ep.turns] == pytest.approx([0.5, 1.0 + 0.75])
    with pytest.raises(RewardModelError, match="lower reward.model_weight"):
        set_reward(ep, 1.0, float("inf"))


def run_args(tmp_path, model_dir, *extra):
    return load_config(None, [
        "--model.name", "tiny", "--env.name", "arithmetic", "--run.steps", "2",
        "--rollout.max_new_tokens", "3", "--rollout.group_size", "2",
        "--rollout.groups_per_step", "2", "--eval.episodes", "0", "--run.progress", "false",
        "--run.out_dir", str(tmp_path / "run"), "--reward.model", str(model_dir), *extra])


def test_a_run_trains_on_the_models_scores_and_logs_them(tmp_path):
    model_dir = save_rm(tmp_path / "rm")
    result = train(run_args(tmp_path, model_dir, "--reward.normalise", "sigmoid",
                            "--reward.env_weight", "0.5", "--reward.model_weight", "2"))
    assert result.steps == 2
    records = read_metrics(tmp_path / "run")
    for record in records:
        used = record["reward/model_used_mean"]
        assert 0 < used < 1  # sigmoid of the scores
        assert record["reward/mean"] == pytest.approx(
            0.5 * record["reward/env_mean"] + 2 * used, abs=1e-5)
        assert record["reward/model_std"] > 0 and record["time/reward_model_s"] > 0
    assert records[0]["reward/model_mean"] != records[1]["reward/model_mean"]


def test_a_bad_reward_model_stops_the_run_before_it_starts(tmp_path):
    model_dir = save_rm(tmp_path / "rm", num_labels=3)
    with pytest.raises(RewardModelError, match="gives 3 scores"):
        train(run_args(tmp_path, model_dir))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
