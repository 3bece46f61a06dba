"""The ``Engine`` protocol: token ids in, sampled token ids and their log-probabilities out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    """Sampled tokens, the stop token included when one was sampled."""
    logprobs: list[float] = field(default_factory=list)
    """Log-probability of each sampled token under the temperature-scaled policy."""
    finish_reason: str = "length"  # "stop" or "length"


Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""A state dict or ``(name, tensor)`` pairs (Hugging Face names)."""


class Sampler(Protocol):
    """What every engine does. New weights arrive only through ``load`` (``version`` is a
    plain attribute: reading it has no effect, and nothing happens when it is set)."""

    version: int
    """Policy version of the weights the engine samples with (set by ``load``)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """Continue every prompt once, all in one batch."""
        ...

    def load(self, weights: Weights | None, version: int) -> None:
        """Sample with ``weights`` as ``version`` from now on. ``None``: the tensors the engine
        holds changed in place (the HF engine on the learner's own model); caches of the old
        weights are dropped (unless the engine keeps them on purpose)."""
        ...

    def release(self, sequences: Sequence[Sequence[int]]) -> None:
        """Forget any cache kept for ``sequences``, which will not be continued (ended
        episodes); an engine that keeps none does nothing."""
        ...

    def close(self) -> None:
        """Free what the engine holds beyond Python's reach (files, threads, GPU memory)."""
        ...


Engine = Sampler
"""The older name of the protocol."""


@torch.no_grad()
def copy_named(model: torch.nn.Module, weights: Weights) -> None:
    """Copy ``weights`` into ``model``'s tensors of the same names, in place (converting the
    dtype); a name the model lacks is an error, not a silently dropped tensor."""
    own = model.state_dict()
    for name, tensor in (weights.items() if isinstance(weights, Mapping) else weights):
        if name not in own:
            raise KeyError(f"load: the sampler has no tensor {name!r}")
        own[name].copy_(tensor.detach())


def describe_sampler(engine: object) -> str:
    """The ``sampler:`` line printed at start-up: which engine samples, in which dtype, on
    which device and with which forward pass (an engine without ``describe``: its class)."""
    describe = getattr(engine, "describe", None)
    return f"sampler: {describe() if describe else type(engine).__name__}"


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args: logits [B, V]. Returns (tokens [B], logprobs [B]).
    The log-probability is taken under softmax(logits / temperature) *before* top-p
    truncation, which is the distribution the update recomputes; with top_p < 1 the
    sampler is slightly off that policy (the usual practice in verl and TRL).
    Greedy (temperature 0) reports log-probabilities at temperature 1.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    probs = logprobs.exp()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]
