"""Exploration options on hand-made batches: each against hand-computed values."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from turnrl.algorithms.advantages import grpo_advantages
from turnrl.algorithms.exploration import (
    Exploration,
    NoveltyCounts,
    StabilityGuard,
    adaptive_entropy_coef,
    dynamic_sampling,
    entropy_threshold,
    high_entropy_mask,
    informative_groups,
    is_truncated,
    overlong_penalty,
    passk_advantages,
    scheduled_temperature,
    weight_advantages,
)
from turnrl.config import ConfigError, ExploreConfig, load_config
from turnrl.types import Episode, Turn


def _episode(group: int, reward: float, *, success: bool | None = None, turns=(),
             status: str = "done", tokens: int = 0) -> Episode:
    ep = Episode("toy", seed=group, group=group, reward=reward, status=status,
                 success=reward > 0 if success is None else success)
    ep.turns = [Turn(0, 1, "a", obs, r, reason, state) for obs, r, reason, state in turns]
    ep.loss_mask = [1] * tokens
    return ep


def test_informative_groups_marks_groups_whose_rewards_differ():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0])
    groups = torch.tensor([7, 7, 3, 3, 9, 9, 4])
    assert informative_groups(rewards, groups).tolist() == [False, False, True, True,
                                                            False, False, False]


def _group(group: int, rewards: list[float]) -> list[Episode]:
    return [_episode(group, r) for r in rewards]


def test_dynamic_sampling_resamples_until_the_batch_is_full():
    first = _group(0, [1, 1]) + _group(1, [0, 1]) + _group(2, [0, 0])
    rounds = {1: _group(10, [0, 0]) + _group(11, [1, 0]) + _group(12, [1, 0])}
    episodes, metrics = dynamic_sampling(first, rounds.__getitem__, groups_needed=3,
                                         max_rounds=5)
    assert [ep.group for ep in episodes] == [1, 1, 11, 11, 12, 12]
    assert metrics == {"dynamic/rounds": 1.0, "dynamic/dropped_groups": 3.0,
                       "dynamic/collected_groups": 6.0, "dynamic/kept_groups": 3.0}


def test_dynamic_sampling_stops_at_the_cap_and_trains_on_what_it_has():
    calls = []

    def collect(round_):
        calls.append(round_)
        return _group(100 + round_, [0, 0])

    first = _group(0, [1, 0]) + _group(1, [1, 1])
    episodes, metrics = dynamic_sampling(first, collect, groups_needed=2, max_rounds=2)
    assert calls == [1, 2]
    assert [ep.group for ep in episodes] == [0, 0]
    assert metrics["dynamic/rounds"] == 2 and metrics["dynamic/kept_groups"] == 1
    # No informative group at all: the first batch is trained on as it is (zero advantages).
    none, metrics = dynamic_sampling(_group(0, [1, 1]), lambda r: _group(5, [0, 0]), 1, 1)
    assert [ep.group for ep in none] == [0, 0] and metrics["dynamic/kept_groups"] == 0


def test_overlong_penalty_is_dapo_eq_13():
    lengths = torch.tensor([10, 16, 18, 20, 25])
    assert overlong_penalty(lengths, 20, 4).tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(lengths, 20, 4, penalty=0.5).tolist() == [0, 0, -0.25, -0.5, -0.5]
    assert overlong_penalty(lengths, 20, 0).tolist() == [0.0] * 5


def test_truncated_episodes_are_recognised_and_masked():
    done = _episode(0, 1.0, turns=[("ok", 1.0, "stop", "s")])
    out_of_turns = _episode(0, 0.0, turns=[("ok", 0.0, "stop", "s")], status="truncated")
    cut_reply = _episode(0, 0.0, turns=[("ok", 0.0, "length", "s")], status="error")
    cut_but_done = _episode(0, 1.0, turns=[("ok", 1.0, "length", "s")])
    assert [is_truncated(e) for e in (done, out_of_turns, cut_reply, cut_but_done)] == [
        False, True, True, False]
    stage = Exploration(ExploreConfig(mask_truncated=True), steps=1, temperature=1.0,
                        entropy_coef=0.0, max_policy_tokens=8)
    mask = stage.loss_mask([done, out_of_turns, cut_reply, cut_but_done], torch.ones(4, 3))
    assert mask.sum(1).tolist() == [3.0, 0.0, 0.0, 3.0]


def test_high_entropy_mask_keeps_the_top_share_of_policy_tokens():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.8, 0.2, 0.7]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # 7.0 is not a policy token
    keep = high_entropy_mask(entropy, mask, 0.5)  # 7 policy tokens: the top ceil(3.5) = 4
    assert keep.tolist() == [[False, True, True, False], [False, True, False, True]]
    assert entropy_threshold(torch.tensor([1.0, 2.0, 3.0]), 1.0) == -math.inf
    # A given (whole-batch) threshold wins over the local one.
    assert high_entropy_mask(entropy, mask, 0.5, threshold=0.85).sum() == 1


def test_adaptive_entropy_coefficient_moves_towards_the_target_and_stays_bounded():
    assert adaptive_entropy_coef(0.01, 0.5, 1.0, 0.02, 0.05) == pytest.approx(0.02)
    assert adaptive_entropy_coef(0.01, 1.5, 1.0, 0.02, 0.05) == pytest.approx(0.0)
    assert adaptive_entropy_coef(0.04, 0.0, 3.0, 0.02, 0.05) == 0.05
    coef = 0.0  # a policy stuck far below target: the coefficient saturates, never explodes
    for _ in range(100):
        coef = adaptive_entropy_coef(coef, 0.1, 2.0, 0.5, 0.05)
    assert coef == 0.05


def test_temperature_schedules():
    assert scheduled_temperature(3, 11, 1.2, 0.6, "constant") == 1.2
    assert [scheduled_temperature(s, 11, 1.2, 0.6, "linear") for s in (0, 5, 10)] == \
        pytest.approx([1.2, 0.9, 0.6])
    cosine = [scheduled_temperature(s, 11, 1.2, 0.6, "cosine") for s in (0, 5, 10)]
    assert cosine == pytest.approx([1.2, 0.9, 0.6])
    assert scheduled_temperature(2, 11, 1.2, 0.6, "cosine") > scheduled_temperature(
        2, 11, 1.2, 0.6, "linear")  # cosine stays high longer


def test_positive_and_negative_weights():
    adv = torch.tensor([[1.0, -2.0], [0.0, 0.5]])
    assert weight_advantages(adv, 2.0, 0.5).tolist() == [[2.0, -1.0], [0.0, 1.0]]


def _passk_by_enumeration(correct: list[bool], k: int) -> list[float]:
    """Each sample's advantage as the mean over the k-subsets holding it of the subset's
    pass@k, minus the mean over all subsets, over the std of the subsets' pass@k."""
    n = len(correct)
    subsets = list(itertools.combinations(range(n), k))
    reward = {s: float(any(correct[i] for i in s)) for s in subsets}
    mean = sum(reward.values()) / len(subsets)
    std = math.sqrt(sum((r - mean) ** 2 for r in reward.values()) / len(subsets))
    if std == 0:
        return [0.0] * n
    return [(sum(reward[s] for s in subsets if i in s) / sum(i in s for s in subsets) - mean)
            / std for i in range(n)]


@pytest.mark.parametrize("correct,k", [
    ([1, 0, 0, 0, 0], 2), ([1, 1, 0, 0, 0, 0], 3), ([0, 0, 0, 1, 0, 1, 0, 0], 4),
    ([1, 1, 1, 0], 2), ([0, 0, 0], 2), ([1, 0, 0, 0, 0, 0, 0, 0], 8),
])
def test_passk_advantages_match_exact_enumeration(correct, k):
    adv = passk_advantages(torch.tensor(correct, dtype=torch.bool),
                           torch.zeros(len(correct), dtype=torch.long), k)
    assert adv.tolist() == pytest.approx(_passk_by_enumeration(correct, k), abs=1e-5)


def test_passk_with_k_one_is_grpo_with_the_population_std():
    correct = torch.tensor([1, 0, 0, 1, 1, 0, 0, 0], dtype=torch.bool)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    r = correct.float()
    n = 4
    grpo = grpo_advantages(r, groups, eps=0) * math.sqrt(n / (n - 1))  # sample -> population
    assert passk_advantages(correct, groups, 1).tolist() == pytest.approx(grpo.tolist(),
                                                                          abs=1e-5)
    with pytest.raises(ValueError, match="at least 5"):
        passk_advantages(correct, groups, 5)


def test_passk_gives_failures_in_a_solved_group_less_blame_than_pass1():
    correct = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    groups = torch.zeros(8, dtype=torch.long)
    k1, k4 = passk_advantages(correct, groups, 1), passk_advantages(correct, groups, 4)
    assert k4[1] > k1[1] and k4[1] < 0  # still negative, but closer to zero


def test_novelty_bonus_is_beta_over_sqrt_count_across_steps():
    counts = NoveltyCounts()
    a = _episode(0, 0.0, turns=[("x", 0, "stop", "s0"), ("y", 0, "stop", "s1")])
    b = _episode(0, 0.0, turns=[("x", 0, "stop", "s0"), ("z", 0, "stop", "s2")])
    first = counts.bonuses([a, b], 0.5)
    assert sum(first, []) == pytest.approx([0.5 / math.sqrt(2), 0.5, 0.5 / math.sqrt(2), 0.5])
    second = counts.bonuses([a], 0.5)
    assert sum(second, []) == pytest.approx([0.5 / math.sqrt(3), 0.5 / math.sqrt(2)])
    restored = NoveltyCounts()
    restored.load_state_dict(counts.state_dict())
    assert restored.counts == counts.counts and len(counts.counts) == 3


def test_shaped_rewards_reach_the_estimator_but_not_the_logged_episodes():
    cfg = ExploreConfig(novelty_coef=1.0, overlong_buffer=2)
    stage = Exploration(cfg, steps=1, temperature=1.0, entropy_coef=0.0, max_policy_tokens=4)
    long = _episode(0, 1.0, turns=[("o", 1.0, "stop", "s")], tokens=4)
    short = _episode(0, 0.0, turns=[("o", 0.0, "stop", "t")], tokens=2)
    shaped = stage.shaped([long, short])
    assert [ep.reward for ep in shaped] == pytest.approx([1.0 + 1.0 - 1.0, 0.0 + 1.0])
    assert shaped[0].turns[-1].reward == pytest.approx(1.0)  # +1 novelty, -1 overlong
    assert (long.reward, short.reward, long.turns[0].reward) == (1.0, 0.0, 1.0)


def test_exploration_advantages_apply_passk_then_weights():
    stage = Exploration(ExploreConfig(pass_k=2, negative_weight=0.5), steps=1,
                        temperature=1.0, entropy_coef=0.0, max_policy_tokens=4)
    episodes = [_episode(0, r) for r in (1.0, 0.0, 0.0, 0.0)]
    adv = stage.advantages(episodes, torch.zeros(4))
    expected = _passk_by_enumeration([True, False, False, False], 2)
    assert adv.tolist() == pytest.approx([expected[0]] + [0.5 * e for e in expected[1:]],
                                         abs=1e-5)
    with pytest.raises(ValueError, match="episode-level"):
        stage.advantages(episodes, torch.zeros(4, 3))


def test_stability_guard_fires_after_patience_and_clears():
    guard = StabilityGuard(entropy_fraction=0.5, clip_fraction=0.3, patience=2)
    flags = []
    with pytest.warns(UserWarning, match="entropy collapse"):
        for entropy in (2.0, 1.5, 0.9, 0.8, 0.7, 1.2):
            flags.append(guard.update(entropy, 0.0)["warn/entropy_collapse"])
    assert flags == [0, 0, 0, 1, 1, 0]
    clip = [guard.update(1.5, c)["warn/clip_extreme"] for c in (0.5, 0.1, 0.5, 0.6, 0.7)]
    assert clip == [0, 0, 0, 1, 1]


def test_adaptive_coefficient_is_used_and_updated_by_the_stage():
    stage = Exploration(ExploreConfig(entropy_target=1.0, entropy_coef_rate=0.1,
                                      entropy_coef_max=0.05), steps=4, temperature=1.0,
                        entropy_coef=0.0, max_policy_tokens=4)
    metrics = stage.end_step({"entropy": 0.5, "clip_fraction": 0.0})
    assert metrics["explore/entropy_coef"] == 0.0 and stage.entropy_coef == pytest.approx(0.05)
    assert stage.step == 1
    saved = stage.state_dict()
    fresh = Exploration(stage.cfg, steps=4, temperature=1.0, entropy_coef=0.0,
                        max_policy_tokens=4)
    fresh.load_state_dict(saved)
    assert (fresh.step, fresh.entropy_coef) == (1, pytest.approx(0.05))


def test_explore_config_checks():
    with pytest.raises(ConfigError, match="explore.top_entropy_fraction"):
        load_config(None, ["--explore.top_entropy_fraction", "0"])
    # async too: each group carries its step's temperature (distributed/plan.py)
    load_config(None, ["--explore.temperature_schedule", "linear", "--run.mode", "async"])
    load_config(None, ["--explore.dynamic_sampling", "true", "--run.mode", "async"])  # async too
    with pytest.raises(ConfigError, match="exceeds rollout.group_size"):
        load_config(None, ["--explore.pass_k", "9"])
    with pytest.raises(ConfigError, match="gigpo is turn-level"):
        load_config(None, ["--explore.pass_k", "4", "--algo.advantage", "gigpo"])
    load_config(None, ["--explore.pass_k", "8"])  # k = group size is fine
