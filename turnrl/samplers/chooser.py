"""The one constructor of the samplers that run on a Hugging Face model in this process, and
the ``sampler:`` line each prints with who it samples for.

``turnrl.policy.sampler`` picks the name and dtype from ``rollout.sampler`` for the learner,
the server and ``rollout.sampler hf`` workers; async ct2 workers and the self-play opponents
build theirs here too. vLLM loads a model directory rather than a model object, so it is
built by ``policy.vllm_sampler`` and ``distributed.worker_engines.vllm_engine``.
"""

from __future__ import annotations

import torch

from turnrl.samplers.base import Sampler, describe_sampler
from turnrl.samplers.hf import HFEngine


def sampler_line(engine: object, who: str = "") -> str:
    """``sampler: hf float32 on cpu (lean pass) (opponent pool-v3)``."""
    return describe_sampler(engine) + (f" ({who})" if who else "")


def build(name: str, dtype: str, model: torch.nn.Module, pad_token_id: int, *, seed: int,
          who: str = "", announce: bool = False, **options) -> Sampler:
    """``name`` (hf or ct2) in ``dtype`` on ``model``: the HF engine on the model's own tensors
    (``dtype`` auto or the model's), on a copy in ``dtype``, or CTranslate2 (``dtype`` its
    compute type). ``options`` are the HF engine's (matmul, reuse_cache, ...). ``announce``:
    print the ``sampler:`` line naming ``who``."""
    if name == "ct2":
        from turnrl.samplers.ct2 import CT2Engine

        engine: Sampler = CT2Engine(model, compute_type=dtype, seed=seed)
    elif getattr(torch, dtype, model.dtype) != model.dtype:
        from turnrl.samplers.copy import HFCopyEngine

        engine = HFCopyEngine(model, getattr(torch, dtype), pad_token_id, seed=seed, **options)
    else:
        engine = HFEngine(model, pad_token_id, seed=seed, **options)
    if announce:
        print(sampler_line(engine, who), flush=True)
    return engine
