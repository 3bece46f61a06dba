"""The ``sampler`` section: how the sampler ``rollout.sampler`` chose holds its state.

None of these options chooses a sampler (that is ``rollout.sampler`` and its dtype, read by
every mode); each tunes the chosen one, and a sampler that has no such state ignores it
(docs/samplers.md): the HF engine's matrix products and its keys and values across turns and
across versions, vLLM's share of its GPU. ``keep_kv_cache`` lives here rather than under
``staleness`` because it is what the sampler's ``load`` does with kept keys and values when a
new version arrives (the HF engine and vLLM alike); it only matters where episodes outlive a
version (async workers with partial rollouts), so only workers read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from turnrl.config.types import Section


@dataclass(frozen=True)
class SamplerConfig(Section):
    matmul: Literal["auto", "torch", "onednn"] = "auto"
    """hf on CPU: the matrix products. onednn: oneDNN's products on weights packed once per
    version (their memory again), in a lean pass for Llama-shaped models (SmolLM2 generates
    1.8-2.0x faster, the repack included, log-probs within ~1e-5 of the learner's); torch:
    the learner's tensors as they are (bit for bit its arithmetic); auto: onednn where the
    model samples on CPU in float32 (bfloat16 with native bf16), torch has oneDNN, the
    weights outgrow the CPU's largest cache and the packed copy fits in half the memory free
    at start-up, else torch"""
    reuse_cache: bool = True
    """hf: keep each episode's KV cache across turns, so a turn prefills only its new tokens"""
    keep_kv_cache: bool = True
    """async rollout workers (hf, vllm): keep live episodes' keys/values across a weight
    update instead of re-reading them with the new weights (PipelineRL); faster, slightly
    more off-policy (docs/benchmarks.md: measured side by side with false). Lock-step
    episodes end within their step, so sync mode always drops them"""
    gpu_memory_utilization: float = 0.5
    """vllm: share of its GPU's memory the engine may take (weights + KV cache)"""

    def _check(self) -> None:
        self._require("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1,
                      "in (0, 1]")
