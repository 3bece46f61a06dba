"""Rewards that are each finite but add up to a return that is not (or one the update's float32
maths cannot hold) fail their own episode, with the reason; the step trains on the others;
every JSON file a run writes parses with a strict reader (JSON has no NaN or Infinity)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from turnrl.config import load_config
from turnrl.envs import StepResult, register_env
from turnrl.metrics import read_metrics
from turnrl.safe_json import dumps
from turnrl.serve.record import RecordedEpisode, Recorder
from turnrl.trainer import train
from turnrl.types import REWARD_LIMIT, Episode, Turn, read_episodes


def _refuse(constant):
    raise ValueError(f"not JSON: {constant}")


def strict_loads(text: str):
    """``json.loads`` that refuses the NaN/Infinity Python's json would accept."""
    return json.loads(text, parse_constant=_refuse)


@register_env("test-huge-rewards")
class HugeRewards:
    """Three turns; an even seed is rewarded -1e308 on each (each finite, their sum -inf),
    an odd one by its reply's characters (so its group's advantages are not all zero)."""

    async def reset(self, seed):
        self.seed, self.turn = seed, 0
        return "Say a digit."

    async def step(self, action):
        self.turn += 1
        reward = -1e308 if self.seed % 2 == 0 else sum(map(ord, action)) % 3 / 3
        return StepResult("Again.", reward, self.turn >= 3, {"success": False, "score": math.nan})


def _turn(reward):
    return Turn(0, 1, "a", "o", reward)


def test_rewards_that_sum_past_finite_fail_the_episode_and_keep_the_return_finite():
    episode = Episode("e", 0, 0, token_ids=[1])
    assert episode.add_turn(_turn(1e308)) is False  # finite, but past the update's range
    assert (episode.status, episode.end_reason) == ("error", "env_error")
    assert "env 'e' gave reward 1e+308 (turn 1): it is not a finite number within" in episode.info["reason"]
    assert episode.reward == 0.0 and [t.reward for t in episode.turns] == [0.0]

    near = Episode("e", 0, 0, token_ids=[1])
    assert near.add_turn(_turn(0.6 * REWARD_LIMIT)) and near.status == "running"
    assert near.add_turn(_turn(0.6 * REWARD_LIMIT)) is False
    assert "makes the episode's return 1.2e+15" in near.info["reason"]
    assert near.reward == 0.6 * REWARD_LIMIT

    # Mixed signs: the return stays small, but a discounted return could reach the sum.
    swing = Episode("e", 0, 0)
    assert swing.add_turn(_turn(0.6 * REWARD_LIMIT)) and not swing.add_turn(
        _turn(-0.6 * REWARD_LIMIT))
    assert "summed |reward|" in swing.info["reason"] and "(turn" not in swing.info["reason"]


@pytest.mark.parametrize("bad", [math.nan, -math.inf, 10**400, "1.0", True, None])
def test_a_reward_that_is_not_a_finite_number_is_refused(bad):
    episode = Episode("e", 0, 0)
    assert episode.add_reward(bad) is False and episode.reward == 0.0
    assert episode.status == "error" and "reward" in episode.info["reason"]


def test_non_finite_values_are_written_as_null():
    value = {"a": [math.nan, (1.5, math.inf)], "b": {"c": -math.inf}, "d": "NaN"}
    assert strict_loads(dumps(value)) == {"a": [None, [1.5, None]], "b": {"c": None},
                                          "d": "NaN"}
    episode = Episode("e", 0, 0, info={"score": math.nan}, logprobs=[-math.inf])
    assert strict_loads(episode.to_json())["info"] == {"score": None}


def test_a_served_reward_that_is_not_finite_is_refused_in_one_line(tmp_path):
    recorder = Recorder(str(tmp_path))
    recorder.episodes["a"] = RecordedEpisode("a")
    for bad in (math.inf, math.nan, -1e308):
        with pytest.raises(ValueError, match="episode 'a': env 'served' gave reward .* not a finite number"):
            recorder.set_reward("a", bad)
    assert recorder.episodes["a"].reward is None and not (tmp_path / "episodes.jsonl").exists()


TINY = ["--model.name", "tiny", "--env.name", "test-huge-rewards", "--rollout.max_new_tokens",
        "3", "--rollout.max_turns", "3", "--run.progress", "false", "--run.tensorboard", "false",
        "--rollout.group_size", "2", "--rollout.groups_per_step", "4", "--eval.episodes", "2",
        "--run.steps", "2", "--run.checkpoint_every", "1", "--optim.lr", "1e-2"]


def test_a_training_run_fails_the_huge_reward_episodes_and_still_updates(tmp_path):
    train(load_config(None, TINY + ["--run.out_dir", str(tmp_path)]))
    episodes = [ep for path in sorted((tmp_path / "episodes").glob("*.jsonl"))
                for ep in read_episodes(path)]
    bad = [ep for ep in episodes if ep.seed % 2 == 0]
    good = [ep for ep in episodes if ep.seed % 2 == 1]
    assert bad and good
    for ep in bad:
        assert (ep.status, ep.end_reason) == ("error", "env_error"), ep.info
        assert "reward -1e+308 (turn 1): it is not a finite number" in ep.info["reason"]
        assert ep.reward == 0.0
    assert all(ep.status == "done" and len(ep.turns) == 3 for ep in good)
    assert len({ep.reward for ep in good}) > 1  # a signal to learn from
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["update/skipped"] for r in records] == [0, 0]
    one, two = (load_file(tmp_path / "checkpoints" / f"step-00000{k}" / "model.safetensors")
                for k in (1, 2))
    assert any(not torch.equal(one[k], two[k]) for k in one)  # step 2 changed the weights
    written = [p for p in Path(tmp_path).rglob("*") if p.suffix in (".json", ".jsonl")]
    assert {p.name for p in written} >= {"metrics.jsonl", "eval_before.json", "state.json",
                                         "eval_after.jsonl"}
    for path in written:
        lines = path.read_text().splitlines() if path.suffix == ".jsonl" \
            else [path.read_text()]
        for line in filter(str.strip, lines):
            strict_loads(line)  # raises on NaN / Infinity


def test_combined_rewards_name_the_part_that_is_not_a_finite_number():
    from turnrl.rewards import combine

    def judge(completion):
        return {"nan": math.nan, "text": "1", "huge": 1e308, "yes": True}[completion]

    def length(completion):
        return 1.0

    reward = combine([(judge, 1.0), (length, 1e308)])
    assert reward("yes") == pytest.approx(1 + 1e308)
    with pytest.raises(ValueError, match="reward function judge returned nan; return a finite"):
        reward("nan")
    with pytest.raises(ValueError, match="returned '1'"):
        reward("text")
    with pytest.raises(ValueError, match="the weighted sum of judge, length overflows"):
        reward("huge")
    with pytest.raises(ValueError, match="the weight of length is inf; give a finite number"):
        combine([(judge, 1.0), (length, math.inf)])
