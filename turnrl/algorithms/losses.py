"""Token-level policy-gradient loss pieces: log-probs, entropy, clipped surrogate, KL, aggregation.

Papers:
- PPO clipped surrogate: Schulman et al. 2017, "Proximal Policy Optimization Algorithms"
  (arXiv:1707.06347), eq. 7.
- Clip-higher (separate low/high clip ranges) and token-level loss aggregation: Yu et al. 2025,
  "DAPO" (arXiv:2503.14476).
- Dual-clip PPO: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
  Reinforcement Learning" (arXiv:1912.09729), eq. 5: for a negative advantage the loss is
  also bounded by ``c * |A|``, so a token the new policy made far likelier than the old one
  (a huge ratio) cannot blow the update up.
- KL estimators k1/k2/k3: Schulman 2020, "Approximating KL Divergence" (blog post); k3 is also
  the GRPO penalty of Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300); ``abs`` is
  ``|log pi - log ref|`` (as verl offers).
- Constant-normalised sum: Liu et al. 2025, "Understanding R1-Zero-Like Training" (Dr. GRPO,
  arXiv:2503.20783).

Departures:
- KL estimators use samples from the current policy, so they estimate KL(pi || ref); k3 is not
  clamped (some implementations clamp the log-ratio for stability).
- ``aggregate_loss`` takes explicit batch totals so that summing micro-batch losses reproduces the
  full-batch loss exactly under gradient accumulation; DAPO/Dr. GRPO define only the full batch.
- Without explicit totals, "token_mean" divides by ``max(mask.sum(), 1)`` so an all-masked batch
  gives 0 rather than NaN.
"""

from collections.abc import Callable

import torch
from torch import Tensor


def _scaled_float(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature`` in float32, making at most one ``[B,T,V]`` copy."""
    x = logits.float()  # no copy when already float32
    if temperature != 1.0:
        # In-place is safe on a fresh copy: the dtype cast does not save its output for backward.
        x = x / temperature if x is logits else x.div_(temperature)
    return x


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(logits / temperature)`` at ``targets``. logits ``[B,T,V]``, targets ``[B,T]``
    long -> ``[B,T]`` float32. Uses logsumexp + gather, so no log-softmax tensor is built."""
    x = _scaled_float(logits, temperature)
    picked = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy ``-sum_v p log p`` of ``softmax(logits / temperature)``. ``[B,T,V] -> [B,T]``."""
    logp = torch.log_softmax(_scaled_float(logits, temperature), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate with DAPO clip-higher:
    ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``, ``r = exp(logprobs - old_logprobs)``.

    logprobs, old_logprobs ``[B,T]``; advantages ``[B,T]`` or ``[B]`` (broadcast over tokens).
    Returns per-token loss ``[B,T]`` and bool ``[B,T]`` marking tokens where the clipped branch
    is strictly smaller (those get zero gradient).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped_obj = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    clipped = clipped_obj < unclipped
    # where() rather than minimum(): on ties the whole gradient goes through the unclipped branch.
    loss = -torch.where(clipped, clipped_obj, unclipped)
    if dual_clip:
        loss, bounded = dual_clip_bound(loss, advantages, dual_clip)
        clipped = clipped | bounded
    return loss, clipped


def dual_clip_bound(loss: Tensor, advantages: Tensor, c: float) -> tuple[Tensor, Tensor]:
    """Dual-clip (Ye et al. 2020): where ``A < 0`` the per-token loss is at most ``c * |A|``
    (``c > 1``). ``[B,T], [B,T] or [B,1] -> [B,T], bool [B,T]`` (where the bound applied; its
    gradient is zero there)."""
    bound = -c * advantages
    bounded = (advantages < 0) & (loss > bound)
    return torch.where(bounded, bound.expand_as(loss), loss), bounded


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token KL(pi || ref) estimate (Schulman 2020). ``[B,T], [B,T] -> [B,T]``.
    k1: ``lp - ref``; k2: ``(lp - ref)^2 / 2``; k3: ``exp(ref - lp) - (ref - lp) - 1`` (>= 0);
    abs: ``|lp - ref|``."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d  # expm1 keeps precision when lp ~ ref
    if estimator == "abs":
        return d.abs()
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: ['k1', 'k2', 'k3', 'abs']")


def _token_mean(vm: Tensor, mask: Tensor, total_tokens, total_seqs, constant) -> Tensor:
    denom = mask.sum().clamp(min=1) if total_tokens is None else total_tokens
    return vm.sum() / denom


def _seq_mean_token_mean(vm: Tensor, mask: Tensor, total_tokens, total_seqs, constant) -> Tensor:
    # Empty rows have a zero sum, so clamping their count to 1 makes them contribute 0.
    rows = vm.sum(-1) / mask.sum(-1).clamp(min=1)
    return rows.sum() / (mask.shape[0] if total_seqs is None else total_seqs)


def _seq_mean_token_sum_norm(vm: Tensor, mask: Tensor, total_tokens, total_seqs, constant):
    seqs = mask.shape[0] if total_seqs is None else total_seqs
    return vm.sum() / (seqs * (mask.shape[1] if constant is None else constant))


LOSS_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token_mean": _token_mean,  # DAPO token-level loss
    "seq_mean_token_mean": _seq_mean_token_mean,  # original GRPO: per-sequence mean, then mean
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,  # Dr. GRPO: sum / (seqs * constant)
}


def aggregate_loss(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    constant: float | None = None,
) -> Tensor:
    """Reduce per-token ``values [B,T]`` under ``mask [B,T]`` (bool or 0/1) to a scalar.

    token_mean: ``sum(v m) / total_tokens`` (default ``mask.sum()``).
    seq_mean_token_mean: ``sum_b (sum_t v m / sum_t m) / total_seqs`` (default B; empty rows 0).
    seq_mean_token_sum_norm: ``sum(v m) / (total_seqs * constant)`` (defaults B and T).
    Pass full-batch totals when accumulating over micro-batches: the micro-batch results then sum
    to the full-batch value.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {sorted(LOSS_AGGREGATIONS)}")
    keep = mask.bool()
    # masked_fill, not values * mask: a NaN/inf on a padded position must not leak into the sum.
    vm = values.masked_fill(~keep, 0.0)
    return LOSS_AGGREGATIONS[mode](vm, keep.to(values.dtype), total_tokens, total_seqs, constant)
