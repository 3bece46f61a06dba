"""Torch set-up shared by every model in a process: the device a name resolves to, threads and
denormal flushing, the keyword a model's forward takes its key/value cache by, and the memory
the machine has free."""

from __future__ import annotations

import functools
import inspect
import os

import torch


def resolve_device(device: str) -> torch.device:
    """'auto' picks CUDA when available; asking for CUDA without one is a clear error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"model.device is '{device}' but no CUDA device is available; "
                         "use --model.device cpu")
    return torch.device(device)


def configure_torch(threads: int | None = None) -> None:
    """Set this process's torch threads (None or 0: torch's default) and flush denormals.

    Call it before any parallel work: worker threads start with the caller's floating-point
    mode. Tiny gradients make Adam's second moments subnormal, which x86 cores handle ~10x
    slower (an AdamW step of SmolLM2-135M took 12.5 s instead of 0.9 s on 2 cores);
    flushing them to zero changes values below 1.2e-38 only.
    """
    if threads:
        torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def cache_kwargs(module: torch.nn.Module, cache: object) -> dict[str, object]:
    """``{name: cache}`` for ``module``'s forward: transformers 5.x names the key/value cache
    ``cache`` (and warns on ``past_key_values``); the 4.x versions the pin allows take only
    ``past_key_values``."""
    # A PEFT model's forward takes **kwargs on to the model it wraps: ask that one.
    inner = module.get_base_model() if hasattr(type(module), "get_base_model") else module
    return {_cache_keyword(type(inner)): cache}


@functools.cache
def _cache_keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else free pages; 0 when unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
