"""A reward model in the loop: rewards combined by weight with turns kept consistent, a
tiny run that trains on them and logs ``reward/model_*``, a served agent's recorded episodes
scored alike, a bad model refused before any step."""

from __future__ import annotations

import statistics

import pytest

from tests.rewards.test_model import save_rm
from turnrl.config import load_config
from turnrl.launch import train
from turnrl.metrics import read_metrics
from turnrl.models import tiny_tokenizer
from turnrl.rewards.model import RewardModel, RewardModelError
from turnrl.trainer.reward_model import set_reward
from turnrl.types import Episode, Turn, read_episodes


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


def assert_rescored(run_dir, model_dir, env_weight, model_weight, normalise, *,
                    turns_carry_env=True) -> int:
    """Each step's saved episodes (run.sample_episodes covering the step) re-scored here from
    their token ids: ``model_score`` is that score and the reward env_weight * env reward +
    model_weight * normalise(the step's scores)[i], turns summing to it (to the model's part
    alone where the turns carried no env reward). Returns the number of episodes checked."""
    tokenizer = tiny_tokenizer()
    rm = RewardModel.load(str(model_dir), policy_tokenizer=tokenizer)
    checked = 0
    for path in sorted((run_dir / "episodes").glob("step-*.jsonl")):
        episodes = read_episodes(path)
        scores = rm.score([tokenizer.decode(ep.token_ids, skip_special_tokens=False)
                           for ep in episodes]).tolist()
        for ep, score, used in zip(episodes, scores, normalise(scores), strict=True):
            assert ep.info["model_score"] == pytest.approx(score, abs=1e-4)
            env_part = env_weight * ep.info["env_reward"]
            assert ep.reward == pytest.approx(env_part + model_weight * used, abs=1e-4)
            turns = ep.reward if turns_carry_env else ep.reward - env_part
            assert sum(t.reward for t in ep.turns) == pytest.approx(turns, abs=1e-5)
        checked += len(episodes)
    return checked


def zscores(scores: list[float]) -> list[float]:
    """By hand: minus the mean, over the sample standard deviation."""
    mean, std = statistics.mean(scores), statistics.stdev(scores)
    return [(s - mean) / std for s in scores]


def test_served_training_scores_the_agents_recorded_episodes(tmp_path):
    """train_agent (ServedSource): the reward model reads the tokens ``turnrl serve``
    recorded, and the agent's returned reward is the env reward it weighs. Recorded turns
    carry no reward of their own (serve/record.py; train_agent's estimators are
    episode-level), so they sum to the model's part."""
    from turnrl.serve.train import train_agent

    async def rollout(client, task) -> float:
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": task}], max_tokens=3)
        return len(reply.choices[0].message.content) / 10  # varies with the reply

    model_dir = save_rm(tmp_path / "rm")
    cfg = load_config(None, [
        "--model.name", "tiny", "--run.steps", "2", "--run.progress", "false",
        "--run.tensorboard", "false", "--eval.episodes", "0", "--serve.port", "0",
        "--rollout.group_size", "2", "--rollout.groups_per_step", "2",
        "--run.sample_episodes", "4", "--run.out_dir", str(tmp_path / "run"),
        "--reward.model", str(model_dir), "--reward.normalise", "zscore",
        "--reward.env_weight", "0.5", "--reward.model_weight", "2"])
    train_agent(rollout, ["Capital of France?", "Name a prime."], cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["reward/model_std"] > 0 and r["time/reward_model_s"] > 0
        assert r["reward/model_used_mean"] == pytest.approx(0, abs=1e-5)  # zscored
        assert r["reward/mean"] == pytest.approx(0.5 * r["reward/env_mean"], abs=1e-5)
    assert assert_rescored(tmp_path / "run", model_dir, 0.5, 2, zscores,
                           turns_carry_env=False) == 2 * 4
