"""A Hugging Face transformers engine for CPU: batched sampling with a KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from turnrl.rollout.engine import Completion, SamplingParams, sample_tokens


class HFEngine:
    """Samples from the very model object the trainer updates, so weight sync is free on CPU.

    All prompts of a call are left-padded into one batch, prefilled once, then decoded token
    by token from the KV cache. A row that samples a stop token is finished; the batch stops
    when every row is finished or ``max_new_tokens`` is reached.
    """

    def __init__(self, model: PreTrainedModel, pad_token_id: int, seed: int = 0):
        self.model = model
        self.pad_token_id = pad_token_id
        self.version = 0
        self.generator = torch.Generator(model.device).manual_seed(seed)

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

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        rows, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
        # Positions count real tokens only, so left padding does not shift them.
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        device = self.model.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = position_ids.to(device)
        stop = torch.tensor(params.stop_token_ids or [-1], dtype=torch.long, device=device)

        cache = DynamicCache()
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
            # Finished rows keep decoding padding; their outputs are ignored.
            tokens = tokens.masked_fill(finished, self.pad_token_id)
            attention_mask = torch.cat([attention_mask, torch.ones((rows, 1), dtype=torch.long,
                                                                   device=device)], 1)
            out = self.model(input_ids=tokens[:, None], attention_mask=attention_mask,
                             position_ids=next_position, past_key_values=out.past_key_values,
                             use_cache=True)
            next_position = next_position + 1
        return completions
