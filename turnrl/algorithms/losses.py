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
- GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071): one
  importance ratio per sequence, ``s = (pi / pi_old)(y)^(1/|y|)``, clipped at the sequence
  level; here in the paper's GSPO-token form (eq. 13-14), which allows per-token advantages.
- CISPO: MiniMax 2025, "MiniMax-M1" (arXiv:2506.13585), eq. 4-5: the importance weight is
  clipped and detached, and every token keeps the REINFORCE gradient ``A grad log pi``.

Departures:
- KL estimators use samples from the current policy, so they estimate KL(pi || ref); k3 is not
  clamped (some implementations clamp the log-ratio for stability).
- ``aggregate_loss`` takes explicit batch totals so that summing micro-batch losses reproduces the
  full-batch loss exactly under gradient accumulation; DAPO/Dr. GRPO define only the full batch.
- Without explicit totals, "token_mean" divides by ``max(mask.sum(), 1)`` so an all-masked batch
  gives 0 rather than NaN.
- GSPO and CISPO return per-token losses and leave the reduction to ``algo.loss_agg``. The GSPO
  paper averages tokens within a sequence, then sequences (``seq_mean_token_mean``; verl forces
  it); CISPO's paper divides by the batch's token count (``token_mean``, the default). In a
  multi-turn episode ``|y|`` is the number of *policy* tokens (environment tokens are context,
  not part of the sampled sequence). GSPO's log-ratio is capped at 10 before ``exp`` (as verl
  does) so one far-off sequence cannot overflow; CISPO's token log-ratio is clamped to
  ``[-20, 20]`` for the same reason. CISPO's paper has no lower clip (``eps_low`` large); here
  ``clip_low`` applies as the weight's floor ``1 - clip_low``, as in verl.
- The paper's clip ranges differ from PPO's: GSPO used ``3e-4`` / ``4e-4`` (its ratio is a
  per-token geometric mean, so it moves far less than a token's); TurnRL does not change
  ``algo.clip_low`` / ``clip_high`` by loss (docs/objectives.md gives the paper's settings).
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


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, Tensor]:
    """GSPO-token (Zheng et al. 2025, eq. 13-14): ``-min(s_t A_t, clip(s_t, 1 - clip_low,
    1 + clip_high) A_t)`` with ``s_t = sg[s] * pi(y_t) / sg[pi(y_t)]`` and the sequence ratio
    ``s = exp(mean_{t in mask} (logprobs - old_logprobs))``.

    Every token of a row has the value ``s`` (one ratio, one clip decision per sign of the
    advantage); its gradient is ``s * A_t * grad log pi(y_t)``: the whole sequence's tokens
    are scaled by its ratio, never by their own. logprobs, old_logprobs, mask ``[B,T]``
    (``mask``: the policy's tokens; ``|y|`` is their count per row); advantages ``[B,T]`` or
    ``[B]``. Returns per-token loss ``[B,T]`` and bool ``[B,T]``: where the clipped branch is
    strictly smaller (zero gradient).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    keep = mask.bool()
    log_ratio = (logprobs - old_logprobs).masked_fill(~keep, 0.0)
    seq_log_ratio = log_ratio.sum(-1) / keep.sum(-1).clamp(min=1)  # [B]
    # sg[log s] + log pi - sg[log pi]: the value is log s, the gradient that of log pi(y_t).
    log_s = (logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = torch.exp(log_s)
    unclipped = ratio * advantages
    clipped_obj = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    clipped = clipped_obj < unclipped
    return -torch.where(clipped, clipped_obj, unclipped), clipped


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4-5): ``-sg[clip(r, 1 - clip_low,
    1 + clip_high)] * A * logprobs``, ``r = exp(logprobs - old_logprobs)``.

    Clipping bounds the *weight* and never removes a token: a token whose ratio left the range
    still gets the gradient ``clip(r) A grad log pi`` (PPO would give it none). The loss value
    is not a surrogate of PPO's scale (it carries ``log pi``); at ``r = 1`` the gradient equals
    PPO's. logprobs, old_logprobs ``[B,T]``; advantages ``[B,T]`` or ``[B]``. Returns per-token
    loss ``[B,T]`` and bool ``[B,T]``: where the weight was clipped (gradient kept).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp((logprobs - old_logprobs).detach().clamp(-20.0, 20.0))
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * logprobs, weight != ratio


PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor, float, float, float], tuple[Tensor, Tensor]]
"""``(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip) -> (per-token
loss [B,T], bool [B,T] clipped)``: one signature for every ``algo.loss``."""


def _ppo(lp, old, adv, mask, clip_low, clip_high, dual_clip):
    return clipped_policy_loss(lp, old, adv, clip_low, clip_high, dual_clip)


def _gspo(lp, old, adv, mask, clip_low, clip_high, dual_clip):
    return gspo_policy_loss(lp, old, adv, mask, clip_low, clip_high)


def _cispo(lp, old, adv, mask, clip_low, clip_high, dual_clip):
    return cispo_policy_loss(lp, old, adv, clip_low, clip_high)


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": _ppo,  # token ratio, PPO/DAPO clipped surrogate (optionally dual-clip)
    "gspo": _gspo,  # sequence ratio, clipped per sequence (Zheng et al. 2025)
    "cispo": _cispo,  # clipped, detached IS weight on every token's log-prob (MiniMax-M1)
}
"""``algo.loss`` names -> the policy loss (the config's ``PolicyLossName`` lists the same)."""


def policy_loss(name: str) -> PolicyLoss:
    """The ``algo.loss`` function registered as ``name``."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


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
