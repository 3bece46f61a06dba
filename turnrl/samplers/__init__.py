"""Samplers: token ids in, sampled token ids and their log-probabilities out.

Every engine the turn loop can sample with lives here: ``base`` (the protocol and the
sampling maths), ``hf`` (transformers' model, on the learner's tensors; its CPU passes
``lean`` and ``onednn``), ``copy`` (the HF engine on a low-precision copy), ``ct2``
(CTranslate2, with ``ct2_refresh`` converting in the background), ``vllm`` (GPUs),
``choice`` (``rollout.sampler auto``: timing candidates at start-up), ``chooser`` (the one
constructor and its ``sampler:`` line), ``model_dirs``
(the directories ct2 and vLLM load from) and ``catalog`` (what ``turnrl samplers`` lists).
"""

from turnrl.samplers.base import Completion, Engine, SamplingParams, sample_tokens
from turnrl.samplers.hf import HFEngine

__all__ = ["Completion", "Engine", "HFEngine", "SamplingParams", "sample_tokens"]
