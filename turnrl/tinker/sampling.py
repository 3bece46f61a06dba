"""Sampling for the Tinker service: draw with a KV cache, then score what was drawn with a
fresh forward pass (``models.score``), so each returned log-prob is exactly what
``forward`` gives for the same tokens (log p at temperature 1, the policy a loss scores).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from turnrl.devices import cache_kwargs
from turnrl.tinker.models import score


def pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
         generator: torch.Generator) -> int:
    """One token from ``logits`` [V]: greedy at temperature 0, else top-k then nucleus
    (Holtzman et al. 2020) sampling of ``softmax(logits / temperature)``."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def draw(model: nn.Module, prompt: list[int], n: int, params: dict, stop_ids: set[int],
         stop_strings: Sequence[str], decode: Callable[[list[int]], str],
         generator: torch.Generator) -> list[tuple[list[int], str]]:
    """``n`` completions of ``prompt``, drawn together (one prompt: no padding), and why each
    ended ('stop' or 'length'); a row that ended draws on unseen until all have."""
    device = next(model.parameters()).device
    x, past = torch.tensor([prompt] * n, device=device), None
    rows: list[list[int]] = [[] for _ in range(n)]
    reasons = ["length"] * n
    for _ in range(int(params.get("max_tokens") or 16)):
        out = model(input_ids=x, **cache_kwargs(model, past), use_cache=True)
        past = out.get("cache", out.get("past_key_values"))
        tokens = [pick(out.logits[i, -1], float(params.get("temperature", 1.0)),
                       int(params.get("top_k", -1)), float(params.get("top_p", 1.0)), generator)
                  for i in range(n)]
        for i, token in enumerate(tokens):
            if reasons[i] == "length":
                rows[i].append(token)
                if token in stop_ids or (stop_strings
                                         and any(s in decode(rows[i]) for s in stop_strings)):
                    reasons[i] = "stop"
        if all(r == "stop" for r in reasons):
            break
        x = torch.tensor([[t] for t in tokens], device=device)
    return list(zip(rows, reasons, strict=True))


def sample(model: nn.Module, prompt: list[int], n: int, params: dict, eos_id: int,
           decode: Callable[[list[int]], str], pad_id: int, prompt_logprobs: bool
           ) -> tuple[list[tuple[list[int], list[float], str]], list[float] | None]:
    """``n`` completions with their log-probs, and the prompt's (NaN first) when asked.
    ``params`` are Tinker's SamplingParams: stop None = the model's end token, [] = none."""
    stop = params.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    stop_ids = {eos_id} if stop is None else {s for s in stop if isinstance(s, int)}
    stop_strings = [] if stop is None else [s for s in stop if isinstance(s, str)]
    seed = params.get("seed")
    generator = torch.Generator().manual_seed(
        int(seed) if seed is not None else int(torch.randint(2**31, ())))
    drawn = draw(model, prompt, n, params, stop_ids, stop_strings, decode, generator)
    with torch.no_grad():  # row by row: no padding, so each is what forward gives that row
        scored = [score(model, [row], pad_id)[0] for row in
                  [prompt + tokens for tokens, _ in drawn] + ([prompt] if prompt_logprobs else [])]
    sequences = [(tokens, scored[i][len(prompt) - 1:].tolist(), reason)
                 for i, (tokens, reason) in enumerate(drawn)]
    prompt_lps = [float("nan")] + scored[-1].tolist() if prompt_logprobs else None
    return sequences, prompt_lps
