"""GSPO and CISPO (``algo.loss``) against hand-computed values, their gradients, and verl's
formulas restated as fixtures (written here from reading verl's ``core_algos.py``; verl is not
imported)."""

import math

import pytest
import torch

from turnrl.algorithms.losses import (
    POLICY_LOSSES,
    aggregate_loss,
    cispo_policy_loss,
    clipped_policy_loss,
    gspo_policy_loss,
    policy_loss,
)
from turnrl.algorithms.offpolicy import decoupled_policy_loss
from turnrl.config import AlgoConfig, ConfigError, PolicyLossName

LN = math.log


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


def _rows(*ratios, old=-1.0):
    """logprobs [B,T] whose token ratios to ``old`` are ``ratios`` (one tuple a row)."""
    old_lp = torch.full((len(ratios), len(ratios[0])), old)
    return old_lp + torch.log(torch.tensor(ratios)), old_lp


# ---- GSPO ------------------------------------------------------------------------------------


def test_gspo_sequence_ratio_counts_only_policy_tokens():
    # Row 0: token ratios (1.21, 9, 1); the 9 is an env token (mask 0) in the middle of a
    # multi-turn episode. s = sqrt(1.21 * 1) = 1.1 (over |y| = 2 policy tokens; counting the
    # env token would give (1.21 * 9)^(1/3) = 2.216). A = +1, clip .2/.28: 1.1 inside, loss -1.1.
    # Row 1: ratios (4, 1, 1), all policy: s = 4^(1/3) = 1.5874; A = +1 -> clipped at 1.28.
    # Row 2: ratios (0.25, 1, 1) but mask (1, 1, 0): s = 0.5; A = -1 -> min(-0.5, -0.8) = -0.8,
    # clipped, loss +0.8.
    lp, old = _rows((1.21, 9.0, 1.0), (4.0, 1.0, 1.0), (0.25, 1.0, 1.0))
    mask = torch.tensor([[1, 0, 1], [1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, clipped = gspo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    keep = mask.bool()
    close(loss[keep], [-1.1, -1.1, -1.28, -1.28, -1.28, 0.8, 0.8], atol=1e-5)
    assert clipped[keep].tolist() == [False, False, True, True, True, True, True]
    # Per-token advantages: one clip decision per token from the one sequence ratio s = 1.5874.
    loss, clipped = gspo_policy_loss(lp[1:2], old[1:2], torch.tensor([[1.0, -1.0, 2.0]]),
                                     mask[1:2], 0.2, 0.28)
    s = 4 ** (1 / 3)
    close(loss, [[-1.28, s, -2.56]], atol=1e-5)  # A = -1: min(-s, -1.28) = -s, unclipped
    assert clipped.tolist() == [[True, False, True]]


def test_gspo_gradient_scales_each_sequence_by_its_own_ratio():
    # Two rows, A = +1, wide clip (never clipped). Row ratios (0.25, 1) -> s = 0.5; (1.21, 1)
    # -> s = 1.1. d loss / d logprob_t = -s A for every token of the row, whatever the token's
    # own ratio (token-level PPO would give -0.25 and -1 in row 0).
    lp, old = _rows((0.25, 1.0), (1.21, 1.0))
    lp.requires_grad_()
    loss, _ = gspo_policy_loss(lp, old, torch.ones(2), torch.ones(2, 2), 10.0, 10.0)
    loss.sum().backward()
    close(lp.grad, [[-0.5, -0.5], [-1.1, -1.1]], atol=1e-6)
    ppo_lp = lp.detach().clone().requires_grad_()
    clipped_policy_loss(ppo_lp, old, torch.ones(2), 10.0, 10.0)[0].sum().backward()
    close(ppo_lp.grad, [[-0.25, -1.0], [-1.21, -1.0]], atol=1e-6)


def test_gspo_token_form_has_the_sequence_objectives_gradient():
    """GSPO-token with one advantage per sequence and seq_mean_token_mean is GSPO (the
    paper's eq. 5) exactly: compare with the sequence objective written out directly."""
    gen = torch.Generator().manual_seed(0)
    lp0 = -torch.rand(3, 5, generator=gen) - 0.5
    old = lp0 + 0.3 * torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    adv = torch.tensor([1.0, -0.5, 2.0])
    token_lp = lp0.clone().requires_grad_()
    per_token, _ = gspo_policy_loss(token_lp, old, adv, mask, 0.2, 0.28)
    aggregate_loss(per_token, mask, "seq_mean_token_mean").backward()
    seq_lp = lp0.clone().requires_grad_()
    s = torch.exp(((seq_lp - old) * mask).sum(-1) / mask.sum(-1))
    objective = torch.minimum(s * adv, s.clamp(0.8, 1.28) * adv)
    (-objective.mean()).backward()
    torch.testing.assert_close(token_lp.grad, seq_lp.grad, atol=1e-6, rtol=1e-5)


# ---- CISPO -----------------------------------------------------------------------------------


def test_cispo_hand_values_and_clipped_tokens_keep_their_gradient():
    # old = ln 0.4; ratios (1.5, 0.5, 1.1), A = (+1, -1, +2), clip .2/.28:
    # weights sg[clip(r)] = (1.28, 0.8, 1.1); logprobs = ln(0.6), ln(0.2), ln(0.44).
    # loss = -w A lp = -1.28 ln .6, +0.8 ln .2, -2.2 ln .44 = 0.6538568, -1.2875503, 1.8061573.
    old = torch.full((1, 3), LN(0.4))
    lp = torch.tensor([[LN(0.6), LN(0.2), LN(0.44)]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, clipped = cispo_policy_loss(lp, old, adv, clip_low=0.2, clip_high=0.28)
    close(loss, [[0.6538568, -1.2875503, 1.8061573]], atol=1e-6)
    assert clipped.tolist() == [[True, True, False]]
    loss.sum().backward()
    # d/d lp = -w A: the two clipped tokens keep a gradient (PPO's would be 0 there).
    close(lp.grad, [[-1.28, 0.8, -2.2]])
    ppo_lp = lp.detach().clone().requires_grad_()
    clipped_policy_loss(ppo_lp, old, adv, 0.2, 0.28)[0].sum().backward()
    close(ppo_lp.grad, [[0.0, 0.0, -2.2]])  # PPO: -r A = -1.1 * 2 on the unclipped token


def test_cispo_gradient_equals_ppo_on_policy():
    """At r = 1 (one epoch, on-policy) CISPO, GSPO and PPO give the same gradient, -A grad lp."""
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(2, 4, generator=gen)
    adv = torch.randn(2, 4, generator=gen)
    mask = torch.ones(2, 4)
    grads = []
    for name in ("ppo", "gspo", "cispo"):
        lp = old.clone().requires_grad_()
        per_token, _ = policy_loss(name)(lp, old, adv, mask, 0.2, 0.28, 0.0)
        aggregate_loss(per_token, mask, "token_mean").backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(grads[2], grads[0])


# ---- the registry, the config and the off-policy path -----------------------------------------


def test_loss_names_agree_with_the_config_and_bad_names_fail():
    assert set(POLICY_LOSSES) == set(PolicyLossName.__args__)
    with pytest.raises(ValueError, match="valid"):
        policy_loss("gpg")
    with pytest.raises(ConfigError, match="algo.dual_clip"):
        AlgoConfig(loss="cispo", dual_clip=3.0)
    assert AlgoConfig(loss="gspo").loss == "gspo"


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_decoupled_path_applies_the_behaviour_weight_to_the_named_loss(name):
    # w = pi_prox / pi_behav = (2, 0.5); the objective's ratio is against the proximal policy.
    prox = torch.tensor([[LN(0.4), LN(0.5)]])
    lp = prox + torch.tensor([[LN(1.21), 0.0]])
    behav = prox - torch.tensor([[LN(2.0), LN(0.5)]])
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    loss, _, weights = decoupled_policy_loss(lp, prox, behav, adv, 0.2, 0.28, loss=name,
                                             mask=mask)
    plain, _ = policy_loss(name)(lp, prox, adv, mask, 0.2, 0.28, 0.0)
    close(weights, [[2.0, 0.5]])
    close(loss, weights * plain)


# ---- verl's formulas, restated -----------------------------------------------------------------


@pytest.fixture
def verl_formulas():
    """verl's ``compute_policy_loss_gspo`` / ``compute_policy_loss_cispo`` maths (verl main,
    Jan 2026), restated: scalar losses, verl's own aggregation (GSPO: always
    seq-mean-token-mean, over the rows with a token, each row's sum over ``count + 1e-8``;
    CISPO: token-mean). ``clip_low`` / ``clip_high`` are verl's clip_ratio_low / high."""
    def gspo(old, lp, adv, mask, clip_low, clip_high):
        log_r = lp - old
        per_row = (log_r * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_s = (lp - lp.detach() + per_row.detach()[:, None]).clamp(max=10.0)
        s = log_s.exp()
        losses = torch.maximum(-adv * s, -adv * s.clamp(1 - clip_low, 1 + clip_high))
        counts = mask.sum(-1)
        rows = (losses * mask).sum(-1) / (counts + 1e-8)
        return (rows * (counts > 0)).sum() / (counts > 0).sum()

    def cispo(old, lp, adv, mask, clip_low, clip_high):
        r = (lp - old).clamp(-20.0, 20.0).exp()
        losses = -r.clamp(1 - clip_low, 1 + clip_high).detach() * adv * lp
        return (losses * mask).sum() / mask.sum()

    return {"gspo": gspo, "cispo": cispo}


@pytest.mark.parametrize("name, agg", [("gspo", "seq_mean_token_mean"),
                                       ("cispo", "token_mean")])
def test_equals_verls_formulas(verl_formulas, name, agg):
    gen = torch.Generator().manual_seed(7)
    old = -torch.rand(4, 6, generator=gen) - 0.2
    lp0 = old + 0.4 * torch.randn(4, 6, generator=gen)  # ratios well outside the clip range
    adv = torch.randn(4, 1, generator=gen).expand(4, 6) + 0.3 * torch.randn(4, 6, generator=gen)
    mask = (torch.rand(4, 6, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0  # every row has a token (verl skips empty rows; TurnRL counts them as 0)
    ours_lp, verl_lp = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    per_token, _ = policy_loss(name)(ours_lp, old, adv, mask, 0.2, 0.28, 0.0)
    ours = aggregate_loss(per_token, mask, agg)
    theirs = verl_formulas[name](old, verl_lp, adv, mask, 0.2, 0.28)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    ours.backward()
    theirs.backward()
    assert ours_lp.grad.abs().sum() > 0
    torch.testing.assert_close(ours_lp.grad, verl_lp.grad, atol=1e-6, rtol=1e-5)
