"""``HFCopyEngine``: the HF engine on its own copy of the learner in a lower precision
(``--rollout.sampler hf --rollout.sampler_dtype bfloat16``, on a CPU with native bf16)."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from turnrl.samplers.hf import HFEngine


class HFCopyEngine(HFEngine):
    """``HFEngine`` on its own copy of the learner in another dtype (bfloat16 on a CPU with
    native bf16: fewer bytes read per decoded token), refreshed by ``load``.

    The learner keeps its dtype; the sampler's log-probs are the copy's, and the mismatch/*
    metrics measure the difference (docs/mismatch.md). A refresh copies every tensor in
    place, converting its dtype (no re-allocation)."""

    def __init__(self, model: PreTrainedModel, dtype: torch.dtype, pad_token_id: int,
                 **kwargs):
        sampler = copy.deepcopy(model).to(dtype).eval().requires_grad_(False)
        # ``matmul`` resolves on the copy: with onednn, its in-place refresh moves the packed
        # weights' version counters, so they repack
        super().__init__(sampler, pad_token_id, **kwargs)

    def load(self, weights, version: int = 0) -> None:
        """Copy the learner's tensors (a state dict or ``(name, tensor)`` pairs) into the
        copy's, then sample as ``version`` (which drops the kept keys and values)."""
        if weights is None:
            raise ValueError("load: a copy of the learner samples from its own tensors; "
                             "give it the learner's weights (turnrl.policy.publish does)")
        super().load(weights, version)
