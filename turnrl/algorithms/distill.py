"""On-policy distillation: the per-token reverse KL to a teacher as an advantage.

The student (the policy being trained) samples episodes as usual; a teacher scores the
sampled policy tokens. On a token ``y_t`` the student sampled, ``log p_student(y_t) -
log p_teacher(y_t)`` is a one-sample estimate of the reverse KL ``KL(student || teacher)`` at
that position; its negative, times ``coef``, is the token's advantage. Minimising the reverse
KL on the student's own samples is on-policy distillation: GKD (Agarwal et al. 2024, "On-Policy
Distillation of Language Models: Learning from Self-Generated Mistakes", arXiv:2306.13649)
with student-generated data and the reverse-KL divergence, and MiniLLM (Gu et al. 2024,
arXiv:2306.08543), which optimises the same reverse KL with a policy gradient.

Departures from the papers:

- Per-token signal, no reward-to-go. MiniLLM's policy gradient weights each token by the
  sum of the reverse KL over the tokens that follow it (the sequence-level gradient); here a
  token's advantage is its own term only (discount 0), as in GKD's token-level loss.
  Lower variance, and it ignores how a token changes the teacher's view of later tokens.
- Sampled tokens only. GKD computes the full-vocabulary divergence at each position; we
  estimate it from the sampled token (one log-prob per token from each model), so the
  teacher never materialises a full distribution for the loss and the signal is an
  advantage the PPO machinery already handles.
- Through the clipped surrogate. The term is a detached advantage fed to the same clipped
  (or decoupled) PPO loss as the task's; at ratio 1 its gradient is exactly the REINFORCE
  estimate ``-(log p_s - log p_t) grad log p_s`` of the per-token reverse KL, and the clip
  bounds how far one update follows it. MiniLLM adds its own clipping and length
  normalisation; we use the run's.
- Optionally mixed with the task reward (``distill.only`` false): the KL advantage is added
  to the estimator's (normalised) task advantage, so ``coef`` trades one against the other.
- Multi-turn: only the policy's own tokens are scored and trained; environment and prompt
  tokens are context for both models.
- A baseline (``distill.baseline mean``, the default): the batch's mean gap over policy
  tokens is subtracted before the sign flip. On its own samples the student's log-prob
  usually exceeds the teacher's, so every raw term is negative and the update pushes down
  every sampled token, the good ones too; a constant baseline leaves the expected gradient
  unchanged (``E[b grad log p] = 0``) and keeps only which tokens the teacher likes more or
  less than average (the usual variance reduction of REINFORCE, Williams 1992). ``none``
  keeps the raw per-token term, as GKD's loss has it.
"""

from __future__ import annotations

import torch


def reverse_kl_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                          loss_mask: torch.Tensor, coef: float, baseline: str = "none"
                          ) -> torch.Tensor:
    """``-coef * (gap - b)`` on policy tokens, 0 elsewhere, where ``gap = log p_student - log
    p_teacher``; detached. ``b`` is 0 (``baseline`` "none") or the mean gap over the batch's
    policy tokens ("mean").

    All tensors ``[B, T]`` aligned with the token ids (entry ``t`` scores token ``t``), as
    ``Batch.old_logprobs`` and ``Batch.loss_mask`` are.
    """
    gap = (student_logprobs - teacher_logprobs).detach() * loss_mask
    if baseline == "mean":
        gap = gap - float(gap.sum()) / max(float(loss_mask.sum()), 1.0)
    elif baseline != "none":
        raise ValueError(f"unknown distillation baseline {baseline!r}; use none or mean")
    return -coef * gap * loss_mask


def per_token(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Advantages as ``[B, T]``: an episode-level ``[B]`` one repeated on its policy tokens."""
    if advantages.dim() == 1:
        return advantages[:, None] * loss_mask
    return advantages


def with_distillation(task_advantages: torch.Tensor, kl_advantages: torch.Tensor,
                      loss_mask: torch.Tensor, only: bool) -> torch.Tensor:
    """The advantages the update trains on: the KL term alone (``only``) or added to the
    task's (``[B]`` or ``[B, T]``); always ``[B, T]``."""
    if only:
        return kl_advantages
    return per_token(task_advantages, loss_mask) + kl_advantages


def mean_reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                    loss_mask: torch.Tensor) -> float:
    """The sampled estimate of the reverse KL, averaged over policy tokens (nats/token)."""
    tokens = float(loss_mask.sum())
    gap = (student_logprobs - teacher_logprobs) * loss_mask
    return float(gap.sum()) / tokens if tokens else 0.0
