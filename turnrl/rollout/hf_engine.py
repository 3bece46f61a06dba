"""A Hugging Face transformers engine for CPU: batched sampling with a KV cache.

The KV cache outlives a call: when every prompt of the next call extends a sequence of the
previous call (the next turn of the same episodes, same weights), only the new tokens are
prefilled. On SmolLM2 a guess-number episode re-read from scratch each turn spends most of
its time in prefill; reusing the cache removes that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from turnrl.rollout.engine import Completion, SamplingParams, sample_tokens


@dataclass
class _KeptCache:
    """What the previous call left: its rows' sequences and their KV cache.

    The cache holds every token of ``sequences[r]`` except the last sampled one, which was
    never fed back; ``attention_mask`` marks its real (non-padding) columns.
    """

    version: int
    sequences: list[list[int]]
    cache: DynamicCache
    attention_mask: torch.Tensor


class HFEngine:
    """Samples from the very model object the trainer updates, so weight sync is free on CPU.

    All prompts of a call are left-padded into one batch, prefilled once, then decoded token
    by token from the KV cache. A row that samples a stop token is finished (it is fed
    padding, masked out, from then on); the batch stops when every row is finished or
    ``max_new_tokens`` is reached.
    """

    def __init__(self, model: PreTrainedModel, pad_token_id: int, seed: int = 0,
                 reuse_cache: bool = True):
        self.model = model
        self.pad_token_id = pad_token_id
        self.reuse_cache = reuse_cache
        self._version = 0
        self._kept: _KeptCache | None = None
        self.generator = torch.Generator(model.device).manual_seed(seed)

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = value
        self._kept = None  # new weights: the cached keys and values are stale

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        if not prompts:
            return []
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(prompts, params)
        finally:
            self.model.train(was_training)

    def _match_kept(self, prompts: Sequence[Sequence[int]]) -> list[int] | None:
        """Row of the kept cache that each prompt extends, or None if any prompt is new."""
        kept = self._kept
        if kept is None or kept.version != self._version or not self.reuse_cache:
            return None
        by_sequence = {(len(s), tuple(s)): row for row, s in enumerate(kept.sequences)}
        lengths = sorted({len(s) for s in kept.sequences})
        rows = []
        for prompt in prompts:
            row = next((by_sequence[(n, tuple(prompt[:n]))] for n in lengths
                        if n <= len(prompt) and (n, tuple(prompt[:n])) in by_sequence), None)
            if row is None:
                return None
            rows.append(row)
        return rows

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        device = self.model.device
        reuse = self._match_kept(prompts)
        if reuse is None:
            cache = DynamicCache()
            past_mask = torch.zeros((len(prompts), 0), dtype=torch.long, device=device)
            new_tokens = [list(p) for p in prompts]
        else:
            kept = self._kept
            index = torch.tensor(reuse, device=device)
            cache = kept.cache
            cache.batch_select_indices(index)
            past_mask = kept.attention_mask[index]
            # The previous call's last sampled token was never fed: it starts the new tokens.
            new_tokens = [list(p[len(kept.sequences[r]) - 1:]) for p, r in zip(prompts, reuse,
                                                                                  strict=True)]
        self._kept = None

        rows, width = len(prompts), max(len(t) for t in new_tokens)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        new_mask = torch.zeros((rows, width), dtype=torch.long)
        for row, tokens in enumerate(new_tokens):
            input_ids[row, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
            new_mask[row, width - len(tokens):] = 1
        input_ids, new_mask = input_ids.to(device), new_mask.to(device)
        # Positions count real tokens only, so padding (left or in between) shifts nothing.
        position_ids = past_mask.sum(dim=1, keepdim=True) + (new_mask.cumsum(dim=1) - 1).clamp(min=0)
        attention_mask = torch.cat([past_mask, new_mask], dim=1)
        stop = torch.tensor(params.stop_token_ids or [-1], dtype=torch.long, device=device)

        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, past_key_values=cache, use_cache=True)
        completions = [Completion() for _ in prompts]
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        next_position = position_ids[:, -1:] + 1
        for step in range(params.max_new_tokens):
            tokens, logprobs = sample_tokens(out.logits[:, -1, :], params.temperature,
                                             params.top_p, self.generator)
            newly_stopped = torch.isin(tokens, stop) & ~finished
            # One device-to-host copy per decode step, not one per row.
            for row, (token, logprob, was_done, stops) in enumerate(zip(
                    tokens.tolist(), logprobs.tolist(), finished.tolist(),
                    newly_stopped.tolist(), strict=True)):
                if not was_done:
                    completions[row].token_ids.append(token)
                    completions[row].logprobs.append(logprob)
                if stops:
                    completions[row].finish_reason = "stop"
            finished |= newly_stopped
            if finished.all() or step == params.max_new_tokens - 1:
                break
            # Finished rows are fed masked-out padding, so their cache stays reusable.
            tokens = tokens.masked_fill(finished, self.pad_token_id)
            attention_mask = torch.cat([attention_mask, (~finished).long()[:, None]], dim=1)
            out = self.model(input_ids=tokens[:, None], attention_mask=attention_mask,
                             position_ids=next_position, past_key_values=out.past_key_values,
                             use_cache=True)
            next_position = next_position + (~finished).long()[:, None]

        if self.reuse_cache:
            self._kept = _KeptCache(self._version,
                                    [list(p) + c.token_ids for p, c in zip(prompts, completions,
                                                                          strict=True)],
                                    out.past_key_values, attention_mask)
        return completions
