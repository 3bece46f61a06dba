"""The sampler/learner mismatch: measured every step, optionally corrected in the loss.

The tokens of an episode were sampled with log-probabilities the sampler computed
(``old_logprobs``); the learner scores the same tokens again with its own kernels, batch
shapes and precision before it updates. On one process in fp32 the two differ by float
noise; a low-precision or different-kernel sampler (vLLM, int8, bf16) makes them differ
more, and the PPO ratio against the sampler's numbers is then biased. The fix every peer
ships: take the trust region around the learner's own pre-update log-probs (the proximal
policy, as in decoupled PPO) and weight each token by ``w = pi_learner / pi_sampler``,
bounded one of two ways:

- truncated importance sampling (``tis``): ``min(w, high)``; Ionides 2008, "Truncated
  Importance Sampling"; for LLM RL with a vLLM sampler: Yao et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training" (fengyao.notion.site).
- masked importance sampling (``mis``): ``w`` inside ``[low, high]``, 0 outside (the token
  or sequence gets no gradient); Liu et al. 2025, "When Speed Kills Stability: Demystifying
  RL Collapse from the Training-Inference Mismatch" (yingru.notion.site). At token level with
  ``[0.5, 5]`` this is IcePop, Ling Team 2025, "Every Step Evolves: Scaling Reinforcement
  Learning for Trillion-Scale Thinking Model" (arXiv:2510.18855): ``icepop`` is accepted as a
  name for it.

Departures: the sequence-level weight is the geometric mean of the token weights
(``exp(mean log w)``, length-normalised as in GSPO, Zheng et al. 2025, arXiv:2507.18071)
rather than the product, which for long multi-turn episodes under- or overflows and would
mask nearly every sequence; the KL is the k3 estimate ``E_sampler[w - 1 - log w]`` of
KL(sampler || learner) on the sampled tokens (Schulman 2020, "Approximating KL divergence").
"""

from __future__ import annotations

import torch
from torch import Tensor

CORRECTIONS = ("off", "tis", "mis", "icepop")
LEVELS = ("token", "sequence")


def log_weights(learner_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor,
                level: str = "token") -> Tensor:
    """``log(pi_learner / pi_sampler)`` per token ``[B,T]``, 0 off ``mask``; at ``sequence``
    level every token of a row carries the row's mean over its masked tokens."""
    if level not in LEVELS:
        raise ValueError(f"unknown mismatch level {level!r}; valid: {list(LEVELS)}")
    mask = mask.bool()
    logw = (learner_logprobs.detach() - sampler_logprobs.detach()).masked_fill(~mask, 0.0)
    if level == "token":
        return logw
    per_row = logw.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_row[:, None].expand_as(logw).masked_fill(~mask, 0.0)


def correction_weights(learner_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor,
                       correction: str, level: str = "token", low: float = 0.5,
                       high: float = 2.0) -> tuple[Tensor, Tensor]:
    """(weights ``[B,T]``, bool ``[B,T]`` of the masked tokens whose weight the bound changed).

    ``tis``: ``min(w, high)``; ``mis``/``icepop``: ``w`` in ``[low, high]``, else 0 (icepop is
    always token level); ``off``: all ones. Weights are detached; 1 off ``mask``.
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown mismatch correction {correction!r}; valid: {list(CORRECTIONS)}")
    mask = mask.bool()
    if correction == "off":
        return torch.ones_like(learner_logprobs), torch.zeros_like(mask)
    if correction == "icepop":
        correction, level = "mis", "token"
    weights = torch.exp(log_weights(learner_logprobs, sampler_logprobs, mask, level))
    if correction == "tis":
        changed = (weights > high) & mask
        weights = weights.clamp(max=high)
    else:
        changed = ((weights < low) | (weights > high)) & mask
        weights = weights.masked_fill(changed, 0.0)
    return weights.masked_fill(~mask, 1.0), changed


def mismatch_sums(learner_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor
                  ) -> dict[str, float]:
    """Sums over the masked tokens (the caller divides by the token count): absolute
    log-prob difference, its maximum, and the k3 KL estimate of KL(sampler || learner)."""
    mask = mask.bool()
    logw = (learner_logprobs.detach() - sampler_logprobs.detach())[mask].double()
    if logw.numel() == 0:
        return {"abs_sum": 0.0, "abs_max": 0.0, "kl_sum": 0.0}
    k3 = torch.expm1(logw) - logw  # w - 1 - log w >= 0
    return {"abs_sum": float(logw.abs().sum()), "abs_max": float(logw.abs().max()),
            "kl_sum": float(k3.sum())}
