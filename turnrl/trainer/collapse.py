"""The template-collapse monitor: ``collapse/*`` metrics each ``run.collapse_every`` updates.

Each policy reply (a run of policy tokens, ``loss_mask`` 1) of the step's episodes is a
sample ``z`` of the policy given its input ``x``, the whole context before it. A few replies
are scored under their own context and under the other chosen contexts of the batch, and
``algorithms/collapse.py`` turns the score matrix into RAGEN-2's mutual-information proxy
(docs/monitoring.md). The cost is bounded: at most ``run.collapse_prompts`` distinct
contexts and ``run.collapse_replies`` replies, so at most their product of sequences go
through one forward pass each (no gradients), with no random draw (the run's random
streams, and so an exact resume, are untouched).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from turnrl.algorithms.collapse import mi_proxy, retrieval_accuracy
from turnrl.trainer.step import score_policy_tokens
from turnrl.types import Batch, Episode

ROWS_PER_PASS = 16
"""Sequences (context + reply) per forward pass, at least one context's replies: bounds the
activations the monitor adds to a step."""


@dataclass(frozen=True)
class Reply:
    """One sampled reply and the context it was sampled after (token ids)."""

    context: tuple[int, ...]
    reply: tuple[int, ...]


def episode_replies(episode: Episode) -> list[Reply]:
    """Every policy reply of ``episode`` (a maximal run of ``loss_mask`` 1) with the tokens
    before it as its context; a reply with no context before it is left out."""
    out, start, mask = [], None, episode.loss_mask
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            if start > 0:
                out.append(Reply(tuple(episode.token_ids[:start]),
                                 tuple(episode.token_ids[start:i])))
            start = None
    return out


def spread(items: list, k: int) -> list:
    """``k`` items evenly spaced over ``items`` (all of them when there are at most ``k``)."""
    if len(items) <= k:
        return list(items)
    return [items[(i * len(items)) // k] for i in range(k)]


def choose(episodes: list[Episode], max_prompts: int, max_replies: int
           ) -> tuple[list[tuple[int, ...]], list[Reply], list[int]]:
    """The contexts to score under (at most ``max_prompts`` distinct ones, spread over the
    batch), the replies to score (at most ``max_replies``, taken round-robin over those
    contexts so that a GRPO group's shared prompt does not fill the quota) and each reply's
    own context's index."""
    by_context: dict[tuple[int, ...], list[Reply]] = {}
    for episode in episodes:
        for reply in episode_replies(episode):
            by_context.setdefault(reply.context, []).append(reply)
    contexts = spread(list(by_context), max_prompts)
    replies, own, depth = [], [], 0
    while len(replies) < max_replies and any(len(by_context[c]) > depth for c in contexts):
        for j, context in enumerate(contexts):
            if depth < len(by_context[context]) and len(replies) < max_replies:
                replies.append(by_context[context][depth])
                own.append(j)
        depth += 1
    return contexts, replies, own


@torch.no_grad()
def score_matrix(model: nn.Module, contexts: list[tuple[int, ...]], replies: list[Reply],
                 own: list[int], temperature: float, pad_id: int,
                 max_positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores[i, j]``, reply ``i``'s mean per-token log-probability after context ``j``
    (``[R, P]``), and each reply's mean per-token entropy after its own context ``own[i]``
    (``[R]``). Each context runs once for all the replies scored after it (the update's
    shared-prefix pass, ``score_policy_tokens``); the LM head runs on reply tokens only. A
    context is cut from the left when it and the reply would pass ``max_positions``."""
    device = next(model.parameters()).device
    scores = torch.zeros(len(replies), len(contexts))
    entropy = torch.zeros(len(replies))
    per_pass = max(1, ROWS_PER_PASS // max(1, len(replies)))  # contexts per forward pass
    for first in range(0, len(contexts), per_pass):
        pairs = [(i, j) for j in range(first, min(first + per_pass, len(contexts)))
                 for i in range(len(replies))]
        rows = []
        for i, j in pairs:
            reply = replies[i].reply
            context = contexts[j][max(0, len(contexts[j]) + len(reply) - max_positions)
                                  if max_positions else 0:]
            rows.append(Episode("", 0, j, token_ids=[*context, *reply],
                                loss_mask=[0] * len(context) + [1] * len(reply),
                                logprobs=[0.0] * (len(context) + len(reply))))
        batch = Batch.from_episodes(rows, torch.zeros(len(rows)), pad_id).to(device)
        logprobs, entropies = score_policy_tokens(model, batch, temperature, entropy=True,
                                                  shared_prefix=True)
        mask = batch.loss_mask[:, 1:]
        count = mask.sum(dim=1)
        mean_logp = ((logprobs * mask).sum(dim=1) / count).cpu()
        mean_entropy = ((entropies * mask).sum(dim=1) / count).cpu()
        for k, (i, j) in enumerate(pairs):
            scores[i, j] = mean_logp[k]
            if j == own[i]:
                entropy[i] = mean_entropy[k]
    return scores, entropy


class CollapseMonitor:
    """Scores a batch's replies each ``every`` calls (``every`` 0: never); see the module."""

    def __init__(self, every: int, max_prompts: int, max_replies: int) -> None:
        self.every, self.max_prompts, self.max_replies = every, max_prompts, max_replies
        self.calls = 0

    def due(self) -> bool:
        """Counts a call; True when this one is to be scored (the first, then every
        ``every``-th)."""
        self.calls += 1
        return self.every > 0 and (self.calls - 1) % self.every == 0

    def metrics(self, model: nn.Module, episodes: list[Episode], temperature: float,
                pad_id: int) -> dict[str, float]:
        """``collapse/mi`` (nats per token, at most log P; 0 with one distinct context),
        ``collapse/retrieval``, ``collapse/own_logp``, ``collapse/cross_logp`` (with two
        contexts or more), ``collapse/entropy`` (per token, under the reply's own context),
        ``collapse/prompts`` and ``collapse/replies``; {} when the batch has no reply."""
        contexts, replies, own = choose(episodes, self.max_prompts, self.max_replies)
        if not replies:
            return {}
        was_training = model.training
        model.eval()  # no dropout (a LoRA adapter's) in a measurement
        try:
            scores, entropy = score_matrix(model, contexts, replies, own, temperature or 1.0,
                                           pad_id, getattr(model.config,
                                                           "max_position_embeddings", None))
        finally:
            model.train(was_training)
        own_t = torch.tensor(own)
        mine = scores.gather(1, own_t.unsqueeze(1)).squeeze(1)
        others = torch.ones_like(scores, dtype=torch.bool).scatter(1, own_t.unsqueeze(1), False)
        out = {
            "collapse/mi": float(mi_proxy(scores, own_t).mean()),
            "collapse/retrieval": float(retrieval_accuracy(scores, own_t)),
            "collapse/own_logp": float(mine.mean()),
            "collapse/entropy": float(entropy.mean()),
            "collapse/prompts": float(len(contexts)),
            "collapse/replies": float(len(replies)),
        }
        if len(contexts) > 1:  # one context: nothing to cross-score
            out["collapse/cross_logp"] = float(scores[others].mean())
        return out
