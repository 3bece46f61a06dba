"""One policy update on a batch of scored episodes; the sync and async trainers share it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from turnrl.algorithms.losses import (
    aggregate_loss,
    clipped_policy_loss,
    entropy_from_logits,
    kl_penalty,
    token_logprobs,
)
from turnrl.config import AlgoConfig, OptimConfig
from turnrl.types import Batch


@dataclass(frozen=True)
class UpdateSettings:
    algo: AlgoConfig
    optim: OptimConfig
    temperature: float
    """Sampling temperature: the update scores tokens under the same tempered policy."""
    agg_constant: int
    """Normaliser of ``seq_mean_token_sum_norm`` (max policy tokens per episode)."""


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """Split a batch for gradient accumulation, rows of similar length together.

    Sorting by length keeps padding (wasted compute) low inside each micro-batch.
    """
    lengths = batch.attention_mask.sum(dim=1)
    order = lengths.argsort(descending=True)
    return [batch.select(order[i:i + size]) for i in range(0, len(batch), size)]


def score_policy_tokens(model: nn.Module, mb: Batch, temperature: float, *,
                        entropy: bool = False, entropy_grad: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and optionally entropies) of the policy's tokens only.

    Returns ``[B, T-1]`` tensors aligned with ``mb.input_ids[:, 1:]``, zero off the loss
    mask. The decoder runs on every token (they are all context), but the LM head and the
    softmax over the vocabulary run only where the policy sampled: in a multi-turn episode
    most tokens are prompt and environment text, and on CPU the 49k-wide softmax over them
    cost about a third of the update.
    Assumes the model's logits are ``lm_head(hidden)`` (optionally soft-capped, as Gemma).
    """
    hidden = model.get_decoder()(input_ids=mb.input_ids,
                                 attention_mask=mb.attention_mask).last_hidden_state
    where = mb.loss_mask[:, 1:].bool()
    logits = model.get_output_embeddings()(hidden[:, :-1][where])  # [N, V]
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = cap * torch.tanh(logits / cap)
    logprobs = torch.zeros(where.shape, dtype=torch.float32, device=logits.device)
    logprobs = logprobs.masked_scatter(where, token_logprobs(logits, mb.input_ids[:, 1:][where],
                                                             temperature))
    if not entropy:
        return logprobs, None
    # Entropy as a metric only needs no graph: skip the extra [N, V] activations.
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        values = entropy_from_logits(logits if entropy_grad else logits.detach(), temperature)
    entropies = torch.zeros_like(logprobs).masked_scatter(where, values)
    return logprobs, entropies


def _micro_batch_loss(model: nn.Module, ref_model: nn.Module | None, mb: Batch,
                      s: UpdateSettings, totals: dict[str, float]) -> tuple[torch.Tensor, dict]:
    """Loss of one micro-batch, already scaled so micro-batch losses sum to the batch loss."""
    mask = mb.loss_mask[:, 1:]
    logprobs, entropy = score_policy_tokens(model, mb, s.temperature, entropy=True,
                                            entropy_grad=s.algo.entropy_coef > 0)
    advantages = mb.advantages[:, None] if mb.advantages.dim() == 1 else mb.advantages[:, 1:]
    per_token, clipped = clipped_policy_loss(logprobs, mb.old_logprobs[:, 1:], advantages,
                                             s.algo.clip_low, s.algo.clip_high)
    stats = {"clipped": float((clipped.float() * mask).sum()),
             "entropy": float((entropy.detach() * mask).sum())}
    if s.algo.kl_coef > 0:
        with torch.no_grad():
            ref_logprobs, _ = score_policy_tokens(ref_model, mb, s.temperature)
        kl = kl_penalty(logprobs, ref_logprobs, s.algo.kl_estimator)
        per_token = per_token + s.algo.kl_coef * kl
        stats["kl"] = float((kl.detach() * mask).sum())
    if s.algo.entropy_coef > 0:
        per_token = per_token - s.algo.entropy_coef * entropy
    loss = aggregate_loss(per_token, mask, s.algo.loss_agg, total_tokens=totals["tokens"],
                          total_seqs=totals["seqs"], constant=s.agg_constant)
    return loss, stats


def policy_update(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch,
                  settings: UpdateSettings, ref_model: nn.Module | None = None) -> dict[str, float]:
    """``algo.epochs`` optimiser steps over ``batch``, accumulating over micro-batches.

    Returns metrics averaged over policy tokens: loss, clip fraction, entropy, KL, grad norm.
    """
    model.train()
    totals = {"tokens": float(batch.loss_mask[:, 1:].sum().clamp(min=1)),
              "seqs": float(len(batch))}
    sums: dict[str, float] = {"loss": 0.0, "clipped": 0.0, "entropy": 0.0, "kl": 0.0}
    grad_norms = []
    for _ in range(settings.algo.epochs):
        optimizer.zero_grad(set_to_none=True)
        for mb in micro_batches(batch, settings.optim.micro_batch_size):
            mb = mb.to(next(model.parameters()).device)
            loss, stats = _micro_batch_loss(model, ref_model, mb, settings, totals)
            loss.backward()
            sums["loss"] += float(loss.detach())
            for key, value in stats.items():
                sums[key] += value
        # max_grad_norm 0 disables clipping (an infinite bound still reports the norm).
        bound = settings.optim.max_grad_norm or float("inf")
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), bound)))
        optimizer.step()
    passes = settings.algo.epochs
    metrics = {
        "loss/policy": sums["loss"] / passes,
        "clip_fraction": sums["clipped"] / totals["tokens"] / passes,
        "entropy": sums["entropy"] / totals["tokens"] / passes,
        "grad_norm": sum(grad_norms) / passes,
    }
    if settings.algo.kl_coef > 0:
        metrics["kl"] = sums["kl"] / totals["tokens"] / passes
    return metrics
