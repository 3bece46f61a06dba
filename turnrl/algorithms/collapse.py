"""Template collapse: how much a policy's replies depend on their input.

RAGEN-2 (Wang et al. 2026, "RAGEN-2: Reasoning Collapse in Agentic RL", arXiv 2604.06268)
splits reasoning quality into within-input diversity, the entropy ``H(Z | X)``, and
cross-input distinguishability, the mutual information ``I(X; Z)`` between the input ``X``
and the reply ``Z``. Under "template collapse" the entropy stays healthy while ``I(X; Z)``
falls: the replies look varied but would be the same whatever the input. The paper gives a
family of online proxies of ``I(X; Z)`` (a retrieval accuracy, z-scored and EMA'd
variants); TurnRL computes the two below from one matrix of scores.

Departures from the paper: scores are per-token means of log-probabilities (replies of
different lengths weigh alike; the paper's proxies score whole sequences), and the MI
proxy is the InfoNCE form (van den Oord et al. 2018, "Representation Learning with
Contrastive Predictive Coding") with the policy itself as the critic, not a z-score.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def mi_proxy(scores: Tensor, own: Tensor) -> Tensor:
    """Per-reply InfoNCE estimate of ``I(X; Z)`` in nats per token.

    ``scores[i, j] = (1 / T_i) * sum_t log pi(z_i,t | x_j, z_i,<t)``: reply ``i`` (``T_i``
    tokens) scored under prompt ``j``; ``own[i]`` is the column of the prompt that reply
    ``i`` was sampled under. ``[R, P]`` float, ``[R]`` long -> ``[R]`` float::

        mi_i = scores[i, own[i]] - log( (1 / P) * sum_j exp(scores[i, j]) )

    ``mean_i mi_i`` is the contrastive lower bound on ``I(X; Z)`` (van den Oord et al. 2018)
    at ``P`` prompts: at most ``log P``, and exactly 0 when every prompt scores a reply
    alike (a policy that ignores its input). With one prompt there is nothing to compare
    and every ``mi_i`` is 0.
    """
    if scores.dim() != 2 or own.shape != scores.shape[:1]:
        raise ValueError(f"mi_proxy: scores must be [R, P] and own [R]; got "
                         f"{tuple(scores.shape)} and {tuple(own.shape)}")
    scores = scores.double()
    mine = scores.gather(1, own.long().unsqueeze(1)).squeeze(1)
    pooled = torch.logsumexp(scores, dim=1) - math.log(scores.shape[1])
    return (mine - pooled).float()


def retrieval_accuracy(scores: Tensor, own: Tensor) -> Tensor:
    """Share of replies whose own prompt scores them highest (RAGEN-2's Retrieval-Acc):
    chance is ``1 / P`` for a policy that ignores its input. A tie counts as a miss, so a
    reply scored alike under every prompt never counts as retrieved. ``[R, P]``, ``[R]``
    -> scalar."""
    mine = scores.gather(1, own.long().unsqueeze(1))
    others = scores.scatter(1, own.long().unsqueeze(1), -math.inf)
    return (mine.squeeze(1) > others.max(dim=1).values).float().mean()
