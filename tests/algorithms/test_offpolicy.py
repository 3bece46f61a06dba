"""Decoupled PPO, ESS, the adaptive staleness bound and episode staleness, against values
computed by hand; plus the vLLM engine's import guard on a machine without vLLM."""

import math
import sys

import pytest
import torch

from turnrl.algorithms.losses import clipped_policy_loss
from turnrl.algorithms.offpolicy import (
    AdaptiveStaleness,
    behaviour_weights,
    decoupled_policy_loss,
    is_too_stale,
    normalised_ess,
    staleness,
)
from turnrl.config import StalenessConfig
from turnrl.types import ENV_VERSION

LOG = math.log

# ---- decoupled PPO ---------------------------------------------------------------------------


def test_decoupled_loss_hand_values():
    # Token 1: r = 1.5, w = 2, A = +1: clip(1.5) = 1.28 < 1.5 -> clipped, loss -2 * 1.28.
    # Token 2: r = 0.5, w = 0.5, A = -1: r A = -0.5, clip(0.5) A = -0.8 -> clipped, loss +0.4.
    # Token 3: r = 1.1, w = 1, A = +2: inside the range, loss -2.2.
    prox = torch.tensor([[0.0, LOG(0.4), LOG(0.5)]])
    logprobs = prox + torch.tensor([[LOG(1.5), LOG(0.5), LOG(1.1)]])
    behav = prox - torch.tensor([[LOG(2.0), LOG(0.5), 0.0]])
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    loss, clipped, weights = decoupled_policy_loss(logprobs, prox, behav, advantages,
                                                   clip_low=0.2, clip_high=0.28)
    assert torch.allclose(loss, torch.tensor([[-2.56, 0.4, -2.2]]), atol=1e-6)
    assert clipped.tolist() == [[True, True, False]]
    assert torch.allclose(weights, torch.tensor([[2.0, 0.5, 1.0]]), atol=1e-6)


def test_decoupled_loss_equals_ppo_when_proximal_is_behaviour():
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 7, generator=gen)
    old = -torch.rand(4, 7, generator=gen)
    advantages = torch.randn(4, generator=gen)
    expected, expected_clipped = clipped_policy_loss(logprobs, old, advantages, 0.2, 0.28)
    for cap in (0.0, 5.0):
        loss, clipped, weights = decoupled_policy_loss(logprobs, old, old, advantages, 0.2,
                                                       0.28, is_cap=cap)
        assert torch.equal(loss, expected)
        assert torch.equal(clipped, expected_clipped)
        assert torch.equal(weights, torch.ones(4, 7))


def test_is_cap_truncates_or_drops():
    prox = torch.tensor([[0.0, 0.0]])
    behav = torch.tensor([[LOG(0.25), LOG(0.5)]])  # w = 4 and 2
    logprobs = prox.clone()  # r = 1
    advantages = torch.tensor([1.0])
    _, _, raw = decoupled_policy_loss(logprobs, prox, behav, advantages, 0.2, 0.2)
    assert torch.allclose(raw, torch.tensor([[4.0, 2.0]]))
    loss, _, truncated = decoupled_policy_loss(logprobs, prox, behav, advantages, 0.2, 0.2,
                                               is_cap=3.0)
    assert torch.allclose(truncated, torch.tensor([[3.0, 2.0]]))
    assert torch.allclose(loss, torch.tensor([[-3.0, -2.0]]))
    loss, _, dropped = decoupled_policy_loss(logprobs, prox, behav, advantages, 0.2, 0.2,
                                             is_cap=3.0, over_cap="drop")
    assert torch.allclose(dropped, torch.tensor([[0.0, 2.0]]))
    assert torch.allclose(loss, torch.tensor([[0.0, -2.0]]))
    with pytest.raises(ValueError, match="over_cap"):
        behaviour_weights(prox, behav, 3.0, over_cap="clip")


def test_decoupled_gradient_is_weighted_ppo_gradient():
    # Unclipped token: d loss / d logprob = -w * A * r. Clipped token: zero gradient.
    prox = torch.tensor([[0.0, 0.0]], requires_grad=True)
    behav = torch.tensor([[LOG(0.5), LOG(0.5)]])  # w = 2
    logprobs = torch.tensor([[LOG(1.1), LOG(1.5)]], requires_grad=True)
    loss, clipped, weights = decoupled_policy_loss(logprobs, prox, behav, torch.tensor([3.0]),
                                                   0.2, 0.28)
    assert not weights.requires_grad
    loss.sum().backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-2.0 * 3.0 * 1.1, 0.0]]), atol=1e-6)
    assert clipped.tolist() == [[False, True]]


# ---- effective sample size ------------------------------------------------------------------


def test_normalised_ess_hand_values():
    assert normalised_ess(torch.ones(2, 3)) == pytest.approx(1.0)
    # (2 + 1 + 1)^2 / (3 * (4 + 1 + 1)) = 16 / 18; the masked-out 100 must not count.
    weights = torch.tensor([[2.0, 1.0], [1.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert normalised_ess(weights, mask) == pytest.approx(16 / 18)
    assert normalised_ess(weights * 1e30, mask) == pytest.approx(16 / 18)  # scale-invariant
    assert normalised_ess(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)


def test_normalised_ess_edge_cases():
    assert normalised_ess(torch.ones(2, 2), torch.zeros(2, 2)) == 1.0
    assert normalised_ess(torch.tensor([math.inf, 1.0, 1.0, 1.0])) == pytest.approx(0.25)
    assert normalised_ess(torch.zeros(3)) == 0.0


# ---- adaptive staleness bound ---------------------------------------------------------------


def test_adaptive_staleness_trajectory():
    ctl = AdaptiveStaleness(max_versions=2, ess_low=0.6, ess_high=0.9, limit=4, patience=2)
    script = [0.95, 0.95, 0.5, 0.7, 0.95, 0.8, 0.95, 0.99, 0.99, 0.99, 0.99, 0.99,
              0.1, 0.1, 0.1, 0.1, 0.1, math.nan, 0.95, 0.95]
    bounds, events = [], []
    for ess in script:
        decision = ctl.update(ess)
        bounds.append(decision.after)
        if decision.changed:
            events.append(decision.event)
    assert bounds == [2, 3, 2, 2, 2, 2, 2, 3, 3, 4, 4, 4, 3, 2, 1, 0, 0, 0, 0, 1]
    assert events == ["grow 2->3 (ess 0.95)", "shrink 3->2 (ess 0.50)", "grow 2->3 (ess 0.99)",
                      "grow 3->4 (ess 0.99)", "shrink 4->3 (ess 0.10)", "shrink 3->2 (ess 0.10)",
                      "shrink 2->1 (ess 0.10)", "shrink 1->0 (ess 0.10)", "grow 0->1 (ess 0.95)"]
    assert ctl.max_versions == 1 and len(ctl.history) == len(script)
    assert [d.action for d in ctl.history[10:12]] == ["hold", "hold"]  # at the limit
    assert ctl.history[16].action == "hold" and ctl.history[16].event == ""  # at the floor


def test_adaptive_staleness_metrics_and_config():
    ctl = AdaptiveStaleness.from_config(StalenessConfig(max_versions=3, ess_low=0.5,
                                                        ess_high=0.8, max_versions_limit=5))
    assert (ctl.max_versions, ctl.ess_low, ctl.ess_high, ctl.limit) == (3, 0.5, 0.8, 5)
    decision = ctl.update(0.85)
    assert decision.metrics() == {"staleness/max_versions": 3.0, "staleness/ess": 0.85,
                                  "staleness/high_streak": 1.0}
    with pytest.raises(ValueError, match="max_versions_limit"):
        AdaptiveStaleness.from_config(StalenessConfig(max_versions=9, max_versions_limit=8))
    with pytest.raises(ValueError, match="patience"):
        AdaptiveStaleness(max_versions=1, patience=0)


# ---- episode staleness ----------------------------------------------------------------------


def test_staleness_ignores_environment_tokens():
    versions = [ENV_VERSION, ENV_VERSION, 5, 5, ENV_VERSION, 7, 7]
    assert staleness(versions, learner_version=8) == 3
    assert staleness(torch.tensor(versions), learner_version=8) == 3
    assert staleness([ENV_VERSION, ENV_VERSION], learner_version=8) == 0
    assert not is_too_stale(versions, 8, max_versions=3)
    assert is_too_stale(versions, 9, max_versions=3)
    with pytest.raises(ValueError, match="newer"):
        staleness(versions, learner_version=6)


# ---- vLLM engine import guard -----------------------------------------------------------------


def test_vllm_engine_imports_without_vllm_and_fails_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    # a fresh import of the module, undone afterwards both in sys.modules and as the package's
    # attribute (left behind, `import turnrl.samplers.vllm as m` in a later test would hand
    # it this copy while `from turnrl.samplers.vllm import ...` finds the original)
    import turnrl.samplers

    monkeypatch.delitem(sys.modules, "turnrl.samplers.vllm", raising=False)
    monkeypatch.delattr(turnrl.samplers, "vllm", raising=False)
    from turnrl.samplers.vllm import VLLMEngine

    with pytest.raises(ImportError, match=r"pip install 'turnrl\[vllm\]'") as info:
        VLLMEngine("/nonexistent/model")
    assert "GPU" in str(info.value) and "\n" not in str(info.value)
