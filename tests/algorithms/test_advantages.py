"""Advantage estimators against hand-computed values."""

import math

import pytest
import torch

from turnrl.algorithms import (
    ADVANTAGE_FNS,
    dr_grpo_advantages,
    group_mean,
    group_std,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

# Group 3 = {1, 0, 0, 0}, group 8 = {1, 1} (all equal), group 1 = {0.5} (singleton).
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.5])
IDS = torch.tensor([3, 3, 8, 3, 3, 8, 1])


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


def test_group_mean_and_std_non_contiguous_ids():
    values = torch.tensor([1.0, 2.0, 3.0, 10.0, 5.0])
    ids = torch.tensor([4, 9, 4, 9, 0])
    # group 4: {1, 3} -> mean 2; group 9: {2, 10} -> mean 6; group 0: {5} -> mean 5
    close(group_mean(values, ids), [2.0, 6.0, 2.0, 6.0, 5.0])
    # sample std: group 4: (1 + 1) / 1 = 2 -> sqrt 2; group 9: (16 + 16) / 1 = 32; singleton 0
    s2, s32 = math.sqrt(2.0), math.sqrt(32.0)
    close(group_std(values, ids), [s2, s32, s2, s32, 0.0])


def test_grpo():
    # group 3: mean 0.25, devs (.75, -.25, -.25, -.25), ss = .5625 + 3 * .0625 = .75,
    # sample var .75 / 3 = .25 -> std .5 -> advantages 1.5, -.5, -.5, -.5
    adv = grpo_advantages(REWARDS, IDS)
    close(adv, [1.5, -0.5, 0.0, -0.5, -0.5, 0.0, 0.0])
    assert not torch.isnan(adv).any()


def test_dr_grpo():
    close(dr_grpo_advantages(REWARDS, IDS), [0.75, -0.25, 0.0, -0.25, -0.25, 0.0, 0.0])


def test_rloo():
    # group 3: 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3; equal group and singleton -> 0
    t = -1.0 / 3.0
    close(rloo_advantages(REWARDS, IDS), [1.0, t, 0.0, t, t, 0.0, 0.0])


def test_reinforce_pp():
    # centred x = (.75, -.25, 0, -.25, -.25, 0, 0), batch mean 0, sample var = .75 / 6 = .125,
    # std = 0.35355339 -> .75 / std = 2.12132034, -.25 / std = -0.70710678
    a, b = 2.12132034, -0.70710678
    close(reinforce_pp_advantages(REWARDS, IDS), [a, b, 0.0, b, b, 0.0, 0.0])


@pytest.mark.parametrize("name", sorted(ADVANTAGE_FNS))
def test_all_equal_rewards_give_zero(name):
    rewards = torch.full((6,), 0.7)
    ids = torch.tensor([5, 5, 5, 2, 2, 11])
    adv = ADVANTAGE_FNS[name](rewards, ids)
    assert torch.isfinite(adv).all()
    close(adv, [0.0] * 6)


def test_integer_rewards_are_accepted():
    close(dr_grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0])), [0.5, -0.5])


def test_every_estimator_is_registered_and_a_new_one_is_one_entry():
    from turnrl.algorithms.estimators import EstimatorSettings, Outcome, make_estimator
    from turnrl.config import AlgoConfig, ConfigError
    from turnrl.registry import ESTIMATORS

    assert set(ADVANTAGE_FNS) <= set(ESTIMATORS)  # outcome-level ones are estimators too
    with pytest.raises(ConfigError, match="did you mean 'rloo'"):
        AlgoConfig(advantage="rlooo")
    # A user's estimator: one function and one registry entry, then the config takes it.
    with pytest.raises(TypeError, match="register it"):  # a bare factory has no level
        ESTIMATORS["sign"] = lambda settings: Outcome(lambda r, g: torch.sign(r - 0.5))
    ESTIMATORS.add("sign", lambda settings: Outcome(lambda r, g: torch.sign(r - 0.5)),
                   level="episode")
    try:
        assert ESTIMATORS.level("sign") == "episode" and ESTIMATORS.options("sign") == ()
        estimator = make_estimator(EstimatorSettings(AlgoConfig(advantage="sign")))
        from turnrl.types import Episode

        eps = [Episode("e", 0, 0, reward=r) for r in (1.0, 0.0)]
        close(estimator.advantages(eps, None, 0), [1.0, -1.0])
    finally:
        del ESTIMATORS["sign"]


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        group_mean(torch.zeros(3), torch.zeros(4, dtype=torch.long))
