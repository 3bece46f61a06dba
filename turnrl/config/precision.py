"""What this machine can sample in: native bf16 read from the CPU at run time (never assumed),
and the CTranslate2 compute types (``rollout.sampler ct2``), checked at start-up.

In the config layer so that the start-up checks (``checks.check_sampler``) can use them; the
engine (``turnrl.samplers.ct2``) uses them.
"""

from __future__ import annotations

from typing import Any

MISSING_CT2 = ("rollout.sampler ct2 needs CTranslate2: pip install 'turnrl[ct2]' "
               "(or pip install ctranslate2)")
CT2_DTYPES = ("int8", "int8_float32", "float32", "bfloat16")
"""``rollout.sampler_dtype`` values the ct2 engine takes (besides ``auto``), as CTranslate2
names its compute types."""
DEFAULT_CT2_DTYPE = "int8"
"""``rollout.sampler_dtype auto``: int8 weights everywhere; never bf16, which is only used when
asked for and the CPU has it."""


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""CPU flags of native bf16 arithmetic (x86: AVX512-BF16, AMX; Arm: bf16); without one, bf16
is emulated, slower than fp32."""


def cpu_has_bf16(flags: set[str] | None = None) -> bool:
    """Native bf16 arithmetic in ``flags`` (default: this CPU's, read at run time)."""
    return bool((cpu_flags() if flags is None else flags) & BF16_FLAGS)


def load_ctranslate2() -> Any:
    """The ``ctranslate2`` module, or ImportError with the one line naming the extra."""
    try:
        import ctranslate2
    except ImportError as exc:
        raise ImportError(MISSING_CT2) from exc
    return ctranslate2


def resolve_ct2_dtype(requested: str, key: str = "rollout.sampler_dtype") -> str:
    """The compute type for ``requested`` (the value of ``key``): ``auto`` is int8; a type this CPU or CTranslate2
    build lacks fails here, at start-up, in one line."""
    if requested == "auto":
        return DEFAULT_CT2_DTYPE
    if requested not in CT2_DTYPES:
        raise ValueError(f"{key} {requested!r} is not a ct2 compute type; "
                         f"use one of auto, {', '.join(CT2_DTYPES)}")
    if "bfloat16" in requested and not cpu_has_bf16():
        raise ValueError(f"{key} {requested}: this CPU has no native bf16 "
                         "(no avx512_bf16/amx_bf16 flag); use int8 or float32")
    supported = load_ctranslate2().get_supported_compute_types("cpu")
    if requested not in supported:
        raise ValueError(f"{key} {requested}: this CTranslate2 build cannot "
                         f"compute it on CPU (it can: {', '.join(sorted(supported))}); "
                         "use int8 or float32")
    return requested
