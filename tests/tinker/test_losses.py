"""Tinker's built-in losses as pure functions: values and gradients by hand."""

import pytest
import torch

from turnrl.tinker.losses import LOSSES, loss_config


def test_cross_entropy_is_minus_weighted_logprob():
    logp = torch.tensor([-1.0, -2.0, -3.0])
    loss = LOSSES["cross_entropy"](logp, {"weights": torch.tensor([0.0, 1.0, 2.0])}, {})
    assert loss.tolist() == [0.0, 2.0, 6.0]


def test_importance_sampling_gradient_is_ratio_times_advantage():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    inputs = {"logprobs": torch.tensor([-1.0, -2.5]), "advantages": torch.tensor([2.0, -1.0])}
    LOSSES["importance_sampling"](logp, inputs, {}).sum().backward()
    ratio = torch.exp(torch.tensor([0.0, 0.5]))
    assert torch.allclose(logp.grad, -ratio * inputs["advantages"])


def test_ppo_clips_the_ratio_where_the_advantage_would_push_it_further():
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5], requires_grad=False)).requires_grad_()
    inputs = {"logprobs": torch.zeros(3), "advantages": torch.tensor([1.0, -1.0, -1.0])}
    config = loss_config("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    loss = LOSSES["ppo"](logp, inputs, config)
    # r=1.5, A>0: clipped at 1.2; r=0.5, A<0: clipped at 0.8; r=1.5, A<0: unclipped r*A
    assert torch.allclose(loss, torch.tensor([-1.2, 0.8, 1.5]))
    loss.sum().backward()
    assert logp.grad[:2].tolist() == [0.0, 0.0] and logp.grad[2] != 0


def test_an_unknown_config_key_names_the_options():
    with pytest.raises(ValueError, match="'clip' is not an option of loss 'ppo'.*clip_low"):
        loss_config("ppo", {"clip": 0.2})
