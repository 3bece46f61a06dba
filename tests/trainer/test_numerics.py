"""Bad numbers never reach the weights or a checkpoint; the loss options behave as written."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.trainer.test_step import _batch, _grouped_episodes
from turnrl.algorithms.losses import clipped_policy_loss, dual_clip_bound, kl_penalty
from turnrl.checkpoint import rng_state, save_checkpoint
from turnrl.config import AlgoConfig, ConfigError, OptimConfig
from turnrl.trainer.step import UpdateSettings, make_optimizer, policy_update

SETTINGS = UpdateSettings(AlgoConfig(), OptimConfig(micro_batch_size=4), 1.0, agg_constant=8)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, before):
    return all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_non_finite_advantages_skip_the_update_and_say_so(tiny):
    model, _ = tiny
    optimizer = make_optimizer(model, OptimConfig())
    batch = _batch(_grouped_episodes())
    batch.advantages[1] = float("nan")  # e.g. a group whose reward was NaN
    before = _state(model)
    with pytest.warns(UserWarning, match="advantage values are not finite"):
        metrics = policy_update(model, optimizer, batch, SETTINGS)
    assert metrics["update/skipped"] == 1 and _unchanged(model, before)
    assert not optimizer.state  # Adam's moments never saw it


def test_a_nan_gradient_skips_the_optimiser_step_and_keeps_adams_moments(tiny):
    model, _ = tiny
    optimizer = make_optimizer(model, OptimConfig())
    batch = _batch(_grouped_episodes())
    assert policy_update(model, optimizer, batch, SETTINGS)["update/skipped"] == 0
    moments = copy.deepcopy(optimizer.state_dict()["state"])
    before = _state(model)
    weight = next(model.parameters())
    hook = weight.register_hook(lambda grad: grad * float("nan"))
    try:
        with pytest.warns(UserWarning, match="optimiser step skipped"):
            metrics = policy_update(model, optimizer, batch, SETTINGS)
    finally:
        hook.remove()
    assert metrics["update/skipped"] == 1 and _unchanged(model, before)
    after = optimizer.state_dict()["state"]
    assert all(torch.equal(after[i][k], moments[i][k]) for i in moments for k in moments[i])
    assert math.isfinite(policy_update(model, optimizer, batch, SETTINGS)["loss/policy"])


def test_a_checkpoint_with_non_finite_weights_is_refused_and_leaves_nothing(tiny, tmp_path):
    model, _ = tiny
    model = copy.deepcopy(model)
    optimizer = make_optimizer(model, OptimConfig())
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="non-finite"):
        save_checkpoint(tmp_path, 1, model, optimizer, rng=rng_state())
    assert not (tmp_path / "checkpoints").exists()  # checked before anything is written


@pytest.mark.parametrize(("key", "value"), [("clip_low", 1.0), ("clip_low", 1.5),
                                            ("dual_clip", 0.5), ("dual_clip", 1.0)])
def test_ranges_that_break_the_objective_are_refused(key, value):
    with pytest.raises(ConfigError, match=f"algo.{key} must be"):
        AlgoConfig(**{key: value})


def test_dual_clip_bounds_negative_advantage_losses_by_c_times_abs_a():
    logprobs = torch.log(torch.tensor([[3.0, 0.5, 3.0]]))  # ratios 3, 0.5, 3 (old lp = 0)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    plain, _ = clipped_policy_loss(logprobs, old, adv, 0.2, 0.28)
    # -min(rA, clip(r)A): r=3,A=-1 -> 3; r=.5,A=-1 -> .8; r=3,A=1 -> -1.28
    assert torch.allclose(plain, torch.tensor([[3.0, 0.8, -1.28]]))
    dual, clipped = clipped_policy_loss(logprobs, old, adv, 0.2, 0.28, dual_clip=2.0)
    assert torch.allclose(dual, torch.tensor([[2.0, 0.8, -1.28]]))  # only the first is bounded
    assert clipped.tolist() == [[True, True, True]]
    loss, bounded = dual_clip_bound(plain, adv, 2.0)
    assert bounded.tolist() == [[True, False, False]] and torch.equal(loss, dual)


def test_abs_kl_estimator():
    lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert torch.allclose(kl_penalty(lp, ref, "abs"), torch.tensor([[0.5, 1.0]]))
