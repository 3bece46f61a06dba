"""What the HF engine's passes must apply for a model to sample what the learner scores.

The engine hands attention explicit 4D masks (rows left-padded, kept pasts continued), and
transformers uses such a mask as given, skipping its own mask functions. So the engine applies
what those would (``MaskPlan``):

- a **sliding window**, measured in each row's real positions as the learner's pass over the
  unpadded sequence measures it (a key is seen while query position - key position < window:
  ``masking_utils.sliding_window_overlay``). Models whose every layer slides take one windowed
  mask (``ONE_MASK_MODELS``); models with ``layer_types`` take a mask per layer type,
  ``{"full_attention": ..., "sliding_attention": ...}`` (``MAPPED_MODELS``). Another model
  type with a window keeps its window unapplied and is warned about at start-up;
- an **additive** float mask for ``eager`` attention, which adds its mask to the scores
  (Gemma 2's default); ``sdpa`` takes booleans;
- **rotary scaling that rescales with length** (``dynamic``, ``longrope``) is static below the
  model's original context, so calls are exact there and refused past it (``check_lengths``).

Models the engine cannot sample exactly are refused at start-up in one line (``mask_plan``):
recurrent layers (a per-row key/value cache cannot carry a recurrent or convolution state),
other layer kinds (chunked, shared key/value), attention kernels that take no 4D mask.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from turnrl.config.types import ConfigError

ONE_MASK_MODELS = frozenset({"mistral", "mixtral", "phi3", "starcoder2"})
"""Model types whose decoder builds one mask for every layer, windowed when
``config.sliding_window`` is set (tests/samplers/test_masks.py checks each against a fresh pass)."""
MAPPED_MODELS = frozenset({"qwen2", "qwen3", "gemma2", "gemma3_text"})
"""Model types whose decoder takes ``{layer type: mask}`` and slides the layers ``layer_types``
names ``sliding_attention`` (tests/samplers/test_masks.py)."""
RECURRENT_LAYERS = frozenset({"conv", "linear_attention", "hybrid", "hybrid_sliding"})
"""transformers' cache layer kinds that hold a recurrent or convolution state."""
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
MASK_FORMATS = {"sdpa": None, "eager": "additive"}


@dataclass(frozen=True)
class MaskPlan:
    """How the engine turns its boolean masks into what the model's attention needs."""

    window: int | None = None
    """Keys further back than this many positions are masked (None: no window applied)."""
    by_layer_type: bool = False
    """Pass ``{"full_attention": ..., "sliding_attention": ...}`` instead of one mask."""
    additive: torch.dtype | None = None
    """Eager attention: a float mask in this dtype, 0 where seen, the dtype's min elsewhere."""
    rope: tuple[str, int] | None = None
    """(rotary type, longest row in tokens) for a rotary scaling that rescales past that."""

    def __call__(self, allowed: torch.Tensor, query_positions: torch.Tensor,
                 real: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """The masks for ``allowed`` (``[rows, 1, queries, keys]``: real keys, causally; the
        queries are the last columns), the queries' positions ``[rows, queries]`` and the
        real key columns ``[rows, keys]``. Without a window or eager attention, ``allowed``
        itself (bit for bit what the engine passed before)."""
        if self.window is None:
            return self._format(allowed)
        windowed = self._format(windowed_mask(allowed, query_positions, real, self.window))
        if not self.by_layer_type:
            return windowed
        return {"full_attention": self._format(allowed), "sliding_attention": windowed}

    def _format(self, mask: torch.Tensor) -> torch.Tensor:
        if self.additive is None:
            return mask
        floor = torch.finfo(self.additive).min
        return torch.zeros(mask.shape, dtype=self.additive, device=mask.device).masked_fill_(
            ~mask, floor)

    def check_lengths(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """Refuse a call whose rows could reach past where the rotary scaling rescales."""
        if self.rope is None or not prompts:
            return
        kind, longest = self.rope
        reach = max(len(prompt) for prompt in prompts) + max_new_tokens
        if reach > longest:
            raise ConfigError(
                f"HF sampler: a row of {reach} tokens (prompt + max_new_tokens) reaches past "
                f"{longest}, where this model's {kind!r} rotary scaling rescales with the "
                "sequence's length, so keys kept from shorter calls carry other frequencies than "
                f"the learner's pass: keep episodes under {longest} tokens, give the model a "
                "static rope scaling (linear, yarn), or sample with --rollout.sampler vllm")


AS_GIVEN = MaskPlan()
"""No window, boolean masks: the engine's masks reach attention unchanged."""


def windowed_mask(allowed: torch.Tensor, query_positions: torch.Tensor, real: torch.Tensor,
                  window: int) -> torch.Tensor:
    """``allowed`` less the keys ``window`` or more positions behind each query. A key's
    position is its count of real columns before it (rows are left-padded, pasts continued);
    every query keeps its own column, so no row is fully masked (NaN for later steps)."""
    key_positions = real.cumsum(dim=1) - 1
    near = (query_positions[:, None, :, None] - key_positions[:, None, None, :]) < window
    queries, keys = allowed.shape[-2:]
    device = allowed.device
    own = (torch.arange(keys, device=device)[None, :]
           == keys - queries + torch.arange(queries, device=device)[:, None])
    return (allowed & near) | own


def prefill_mask(real: torch.Tensor, start: int) -> torch.Tensor:
    """``[rows, 1, new, start + new]`` for feeding the columns from ``start`` of ``real``
    (``[rows, start + new]``): real keys, causally; a padding query also sees itself, so no
    row is fully masked (which can give NaN keys/values for later steps)."""
    width = real.shape[1] - start
    device = real.device  # the model's: CPU-made positions would not mix on CUDA
    columns = torch.arange(start + width, device=device)
    rows = start + torch.arange(width, device=device)
    causal = columns[None, :] <= rows[:, None]
    own = columns[None, :] == rows[:, None]
    return ((real[:, None, :] & causal) | own)[:, None]


def mask_plan(model: torch.nn.Module) -> MaskPlan:
    """The plan for ``model``, or a ``ConfigError`` naming why the engine cannot sample it
    exactly. Warns when a sliding window stays unapplied (a model type not checked here)."""
    config = model.config.get_text_config()
    if (why := unsupported(config)) is not None:
        raise ConfigError(f"HF sampler: model type {config.model_type!r} {why}")
    fmt = getattr(config, "_attn_implementation", None) or "sdpa"
    if fmt not in MASK_FORMATS:
        raise ConfigError(
            f"HF sampler: attention implementation {fmt!r} takes no explicit 4D mask, which "
            "the engine needs for left-padded rows and kept keys and values: load the model "
            "with attn_implementation 'sdpa' or 'eager', or sample with --rollout.sampler vllm")
    window, by_layer_type = sliding_window(config)
    return MaskPlan(window, by_layer_type, model.dtype if fmt == "eager" else None,
                    rescaling_rope(config))


def layer_kinds(config: object) -> list[str]:
    """transformers' own cache layer kinds for ``config`` (what ``DynamicCache`` builds)."""
    try:
        return list(get_layer_types_and_kwargs(config)[0])
    except (AttributeError, TypeError, KeyError):  # a config without per-layer fields
        return list(getattr(config, "layer_types", None) or ATTENTION_LAYERS[:1])


def unsupported(config: object) -> str | None:
    """Why the engine's per-row key/value cache cannot sample ``config``'s model exactly."""
    kinds = sorted(set(layer_kinds(config)))
    if recurrent := [kind for kind in kinds if kind in RECURRENT_LAYERS]:
        return (f"has recurrent layers ({', '.join(recurrent)}): the HF sampler keeps keys "
                "and values per row across calls, which cannot carry a recurrent or "
                "convolution state through a partial rollout; sample with --rollout.sampler "
                "vllm")
    if other := [kind for kind in kinds if kind not in ATTENTION_LAYERS]:
        return (f"has layers of kind {', '.join(other)}, which the HF sampler's per-row "
                "key/value cache does not hold (full or sliding attention only); sample with "
                "--rollout.sampler vllm")
    if getattr(config, "use_bidirectional_attention", False):
        return "attends both ways (use_bidirectional_attention): the HF sampler is causal"
    return None


def sliding_window(config: object) -> tuple[int | None, bool]:
    """(the window the engine applies or None, whether it passes a mask per layer type)."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if not window or (kinds is not None and "sliding_attention" not in kinds):
        return None, False
    if config.model_type in MAPPED_MODELS:
        return window, True
    if config.model_type in ONE_MASK_MODELS and kinds is None:
        return window, False
    warnings.warn(unapplied_window_warning(config), stacklevel=3)
    return None, False


def unapplied_window_warning(config: object) -> str:
    """What a user must know about a window the engine does not apply."""
    window = config.sliding_window
    return (f"this model's attention has a {window}-token sliding window, which the HF sampler "
            f"does not apply to model type {config.model_type!r}: past {window} tokens of "
            "context it samples with full attention, and its log-probs drift from the "
            f"learner's (mismatch/* reports it): keep episodes under {window} tokens")


def rescaling_rope(config: object) -> tuple[str, int] | None:
    """(rotary type, longest row) where a rotary scaling rescales with the sequence's length
    (transformers' ``dynamic_rope_update``): ``dynamic`` past ``max_position_embeddings``,
    ``longrope`` past its ``original_max_position_embeddings``; None for static ones."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    nested = [p for p in params.values() if isinstance(p, dict)] or [params]  # per layer type
    limits = []
    for part in nested:
        kind = str(part.get("rope_type", part.get("type", "default")))
        if "dynamic" in kind:
            limits.append((kind, config.max_position_embeddings))
        elif kind == "longrope":
            limits.append((kind, part.get("original_max_position_embeddings")
                           or config.max_position_embeddings))
    return min(limits, key=lambda limit: limit[1]) if limits else None
