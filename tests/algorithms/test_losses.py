"""Loss pieces against hand-computed values."""

import math

import pytest
import torch

from turnrl.algorithms import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    clipped_policy_loss,
    entropy_from_logits,
    kl_penalty,
    token_logprobs,
)


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


# exp(logits) = (1, 4, 9) at T=1 and exp(logits / 2) = (1, 2, 3) at T=2.
LOGITS = torch.tensor([[[0.0, 2 * math.log(2.0), 2 * math.log(3.0)]]])


def test_token_logprobs_with_temperature():
    target = torch.tensor([[1]])
    close(token_logprobs(LOGITS, target), [[math.log(4 / 14)]])
    close(token_logprobs(LOGITS, target, temperature=2.0), [[math.log(2 / 6)]])
    close(token_logprobs(LOGITS, torch.tensor([[2]]), temperature=2.0), [[math.log(3 / 6)]])


def test_token_logprobs_bf16_input_and_grad():
    logits = LOGITS.to(torch.bfloat16).requires_grad_()
    lp = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert lp.dtype == torch.float32
    close(lp, [[math.log(1 / 6)]], atol=1e-2)
    lp.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad.float()).all()


def test_entropy():
    # uniform over V = 5, whatever the constant offset: log 5
    close(entropy_from_logits(torch.full((2, 3, 5), 7.0)), torch.full((2, 3), math.log(5.0)))
    # p = (1, 2, 3) / 6: H = log 6 - (2 log 2 + 3 log 3) / 6 = 1.791759 - 0.780355 = 1.011404
    close(entropy_from_logits(LOGITS, temperature=2.0), [[1.011404]])


def _ratios(*r):
    """logprobs [1,n] with old_logprobs 0 so that exp(lp - old) = r."""
    return torch.log(torch.tensor([r])), torch.zeros(1, len(r))


def test_clip_higher_asymmetry():
    lp, old = _ratios(1.25)
    adv = torch.tensor([[1.0]])
    loss, clipped = clipped_policy_loss(lp, old, adv, clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.25]])  # 1.25 < 1.28: inside the range
    assert not clipped.any()
    loss, clipped = clipped_policy_loss(lp, old, adv, clip_low=0.2, clip_high=0.2)
    close(loss, [[-1.2]])  # min(1.25, 1.2) = 1.2
    assert clipped.all()


def test_clipping_table_and_gradient():
    # ratio, advantage -> loss, clipped?  (clip_low .2, clip_high .28)
    # 1.25, +1 -> -1.25, no | 0.7, -1 -> min(-.7, -.8) = -.8 -> .8, yes
    # 0.7, +1 -> min(.7, .8) -> -.7, no | 1.5, -1 -> min(-1.5, -1.28) -> 1.5, no
    # 1.0, +2 -> -2, no (tie) | 1.5, +1 -> min(1.5, 1.28) -> -1.28, yes
    lp, old = _ratios(1.25, 0.7, 0.7, 1.5, 1.0, 1.5)
    lp.requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0, 1.0]])
    loss, clipped = clipped_policy_loss(lp, old, adv, clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.25, 0.8, -0.7, 1.5, -2.0, -1.28]])
    assert clipped.tolist() == [[False, True, False, False, False, True]]
    # d/dlp of -r A = -r A where unclipped; zero where the clipped branch is active
    loss.sum().backward()
    close(lp.grad, [[-1.25, 0.0, -0.7, 1.5, -2.0, 0.0]])


def test_clipped_policy_loss_broadcasts_sequence_advantages():
    lp, old = torch.zeros(2, 3), torch.zeros(2, 3)
    loss, _ = clipped_policy_loss(lp, old, torch.tensor([2.0, -1.0]), 0.2, 0.2)
    close(loss, [[-2.0] * 3, [1.0] * 3])


def test_kl_estimators():
    lp, ref = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-2.0, -1.0, -3.0]])
    # d = lp - ref = (1, -1, 0)
    close(kl_penalty(lp, ref, "k1"), [[1.0, -1.0, 0.0]])
    close(kl_penalty(lp, ref, "k2"), [[0.5, 0.5, 0.0]])
    # ref - lp = -1: e^-1 + 1 - 1 = 0.36787944; ref - lp = 1: e - 1 - 1 = 0.71828183
    close(kl_penalty(lp, ref, "k3"), [[0.36787944, 0.71828183, 0.0]])
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 7, generator=g) * 3, torch.randn(4, 7, generator=g) * 3
    assert (kl_penalty(a, b, "k3") >= 0).all()
    with pytest.raises(ValueError, match="valid"):
        kl_penalty(lp, ref, "k4")


VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_aggregation_modes():
    close(aggregate_loss(VALUES, MASK, "token_mean"), 7 / 3)  # (1 + 2 + 4) / 3
    close(aggregate_loss(VALUES, MASK, "token_mean", total_tokens=7.0), 1.0)
    close(aggregate_loss(VALUES, MASK, "seq_mean_token_mean"), 2.75)  # (1.5 + 4) / 2
    close(aggregate_loss(VALUES, MASK, "seq_mean_token_sum_norm"), 7 / 6)  # 7 / (2 * 3)
    close(aggregate_loss(VALUES, MASK, "seq_mean_token_sum_norm", constant=10.0), 0.35)
    # an empty row adds 0 to the sequence mean: (2 + 0) / 2 = 1
    empty = torch.tensor([[True, True, True], [False, False, False]])
    close(aggregate_loss(VALUES, empty, "seq_mean_token_mean"), 1.0)


def test_masked_nan_does_not_leak():
    values = torch.tensor([[1.0, float("nan")]])
    close(aggregate_loss(values, torch.tensor([[1, 0]]), "token_mean"), 1.0)


def test_unknown_aggregation():
    assert set(LOSS_AGGREGATIONS) == {
        "token_mean",
        "seq_mean_token_mean",
        "seq_mean_token_sum_norm",
    }
    with pytest.raises(ValueError, match="valid"):
        aggregate_loss(VALUES, MASK, "sum")


@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
def test_micro_batch_accumulation_identity(mode):
    g = torch.Generator().manual_seed(1)
    values = torch.randn(4, 5, generator=g)
    lengths = torch.tensor([5, 2, 0, 3])  # includes an empty row
    mask = torch.arange(5) < lengths.unsqueeze(1)
    full = aggregate_loss(values, mask, mode)
    totals = dict(total_tokens=float(mask.sum()), total_seqs=4.0, constant=5.0)
    parts = sum(aggregate_loss(values[i : i + 2], mask[i : i + 2], mode, **totals) for i in (0, 2))
    close(parts, full.item(), atol=1e-6)
    # and the halves on their own (without totals) would not, in general, sum to it
    naive = sum(aggregate_loss(values[i : i + 2], mask[i : i + 2], mode) for i in (0, 2))
    assert not torch.isclose(naive, full)
