"""Success replay (algorithms/replay.py): which groups get a past success, which success is
kept and for how long, and a real run that replays and resumes with its buffer."""

from __future__ import annotations

import torch

from turnrl.algorithms.replay import SuccessReplay, best_successes, failed_groups, task_key
from turnrl.checkpoint import latest_checkpoint, load_component
from turnrl.config import load_config
from turnrl.metrics import read_metrics
from turnrl.trainer import train
from turnrl.types import Episode


def episode(prompt: list[int], group: int, reward: float, seed: int = 0) -> Episode:
    """Prompt tokens (mask 0), then two policy tokens (mask 1)."""
    return Episode(env="e", seed=seed, group=group, token_ids=prompt + [7, 8],
                   loss_mask=[0] * len(prompt) + [1, 1], logprobs=[0.0] * len(prompt) + [-1.0, -2.0],
                   reward=reward, success=reward > 0)


def test_a_task_is_its_prompt_and_a_failed_group_is_one_without_signal():
    assert task_key(episode([1, 2], 0, 0)) == task_key(episode([1, 2], 5, 1, seed=9))
    assert task_key(episode([1, 2], 0, 0)) != task_key(episode([1, 3], 0, 0))
    eps = [episode([1], 0, 0), episode([1], 0, 0), episode([2], 1, 0), episode([2], 1, 1)]
    assert failed_groups(eps) == [(0, 0)]
    best = best_successes([episode([1], 0, 0.5), episode([1], 0, 0.9), episode([2], 1, 0)])
    assert list(best) == [0] and best[0].reward == 0.9


def test_a_kept_success_joins_a_later_all_failed_group_of_its_task_until_it_is_too_old():
    replay = SuccessReplay(max_age=2)
    first = [episode([1], 0, 0), episode([1], 0, 0.7), episode([2], 1, 0), episode([2], 1, 0)]
    mixed, metrics = replay.mix(first)
    assert mixed == first and metrics["replay/groups"] == 0  # nothing kept yet
    assert metrics["replay/kept_tasks"] == 1
    # step 2: task [1] fails in group 3, task [2] fails again (never solved): only [1] replays
    second = [episode([1], 3, 0), episode([1], 3, 0), episode([2], 4, 0), episode([2], 4, 0)]
    mixed, metrics = replay.mix(second)
    assert len(mixed) == 5 and metrics["replay/groups"] == 1 and metrics["replay/age_mean"] == 1
    again = mixed[-1]
    assert again.group == 3 and again.reward == 0.7 and again.info["guided"] == "replay"
    assert again.logprobs[-2:] == [-1.0, -2.0]  # the sampler's: decoupled PPO weights them
    assert first[1].group == 0 and "guided" not in first[1].info  # a copy, not the original
    replay.mix([episode([3], 0, 0)])  # step 3: age 2, still kept
    assert replay.mix([episode([1], 0, 0), episode([1], 0, 0)])[1]["replay/groups"] == 0
    # step 4: age 3 > 2, dropped


def test_a_newer_success_replaces_the_kept_one_and_the_state_round_trips():
    replay = SuccessReplay(max_age=5)
    replay.mix([episode([1], 0, 0.2), episode([1], 0, 0)])
    replay.mix([episode([1], 0, 0.4), episode([1], 0, 0)])
    restored = SuccessReplay(max_age=5)
    restored.load_state_dict(replay.state_dict())
    mixed, _ = restored.mix([episode([1], 0, 0), episode([1], 0, 0)])
    assert mixed[-1].reward == 0.4 and mixed[-1].info["replay_age"] == 1


def test_a_run_with_success_replay_trains_on_replayed_successes_and_checkpoints_them(tmp_path):
    """The tiny random model succeeds at say-digit (one prompt) in a few percent of episodes:
    some groups succeed, and later all-failed groups of the same prompt get their success."""
    cfg = load_config(None, ["--model.name", "tiny", "--env.name", "say-digit",
                             "--rollout.max_new_tokens", "3", "--rollout.group_size", "4",
                             "--rollout.groups_per_step", "4", "--run.steps", "6",
                             "--explore.success_replay_age", "6", "--eval.episodes", "0",
                             "--run.progress", "false", "--run.tensorboard", "false",
                             "--run.threads", "1", "--run.out_dir", str(tmp_path)])
    train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert sum(r["replay/groups"] for r in records) > 0, records
    # replayed episodes are off-policy: the update is decoupled PPO, its weights reported
    assert all("offpolicy/weight_mean" in r and r["update/skipped"] == 0 for r in records)
    assert all(torch.isfinite(torch.tensor([r["loss/policy"], r["grad_norm"]])).all()
               for r in records)
    kept = load_component(latest_checkpoint(tmp_path), "replay")
    assert kept["step"] == 6 and kept["kept"]  # the buffer travels with the checkpoint
