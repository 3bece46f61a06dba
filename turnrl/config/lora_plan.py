"""The shape of ``model.lora``: parsed into a small typed record, each mistake a one-line
``ConfigError`` (docs/lora.md).

Only the shape is checked here (the config layer loads no model); that the target modules
exist in the model is checked when the adapter is added (``turnrl.lora.add_adapter``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from turnrl.config.types import ConfigError

LORA_KEYS = ("r", "alpha", "dropout", "target_modules")
ALL_LINEAR = "all-linear"
"""PEFT's name for every linear layer of the decoder (attention and MLP projections; the
output head is left out)."""


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter: ``W x + (alpha / r) * B A x`` on each targeted linear layer."""

    r: int
    """Rank of A and B."""
    alpha: float
    """Scale numerator: the update is scaled by alpha / r."""
    dropout: float
    """Dropout on the adapter's input (0: the update is deterministic, as RL's ratios want)."""
    target_modules: tuple[str, ...] | str
    """Module names (a name matches a module whose dotted path ends with it) or 'all-linear'."""


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _target_modules(raw: Any) -> tuple[str, ...] | str:
    """'all-linear', a comma-separated string of names, or a list of names."""
    names = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        names = None
    names = [n.strip() for n in names or () if n.strip()]
    if not names:
        raise ConfigError("model.lora.target_modules must be 'all-linear' or module names, e.g. "
                          f"--model.lora.target_modules q_proj,v_proj; got {raw!r}")
    return ALL_LINEAR if names == [ALL_LINEAR] else tuple(names)


def parse_lora(raw: Mapping[str, Any]) -> LoraSpec | None:
    """``model.lora`` as a ``LoraSpec`` (None when empty or r is 0: full fine-tuning)."""
    extra = [str(k) for k in raw if k not in LORA_KEYS]
    if extra:
        raise ConfigError(f"model.lora: unknown key '{extra[0]}'; valid keys: "
                          f"{', '.join(LORA_KEYS)}")
    r = raw.get("r", 0)
    if not isinstance(r, int) or isinstance(r, bool) or r < 0:
        raise ConfigError(f"model.lora.r must be a whole number >= 0 (0 = full fine-tuning), "
                          f"e.g. --model.lora.r 16; got {r!r}")
    if r == 0:
        return None
    alpha = raw.get("alpha", 2 * r)
    if not _number(alpha) or alpha <= 0:
        raise ConfigError(f"model.lora.alpha must be a number > 0 (the update is scaled by "
                          f"alpha / r), e.g. --model.lora.alpha {2 * r}; got {alpha!r}")
    dropout = raw.get("dropout", 0.0)
    if not _number(dropout) or not 0 <= dropout < 1:
        raise ConfigError(f"model.lora.dropout must be a number in [0, 1); got {dropout!r}")
    return LoraSpec(r, float(alpha), float(dropout),
                    _target_modules(raw.get("target_modules", ALL_LINEAR)))
