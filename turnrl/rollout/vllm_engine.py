"""A vLLM engine for GPU rollout workers, with in-place weight updates from the learner.

Status: written against vLLM's documented offline API and read sources (0.10.2 and later);
not run on a GPU yet. ``tests/test_vllm_gpu.py`` checks it on a GPU host with vLLM installed.

Choices (and where they depart from vLLM's defaults):

- Log-probabilities. vLLM's V1 sampler returns, by default (``logprobs_mode="raw_logprobs"``),
  log-probabilities of the raw model distribution: temperature 1, before penalties and top-k/p.
  The ``Engine`` contract is the temperature-scaled policy, so the engine is built with
  ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2): the log-probability of the sampled
  token under the distribution it was actually drawn from. With ``top_p = 1`` (and no
  penalties, which are never set here) this is ``log_softmax(logits / T)``, exactly what
  ``HFEngine`` reports and the learner recomputes. With ``top_p < 1`` it is the nucleus
  *renormalised* probability (the true sampler), while ``HFEngine`` reports the probability
  before truncation; the two engines then differ by ``-log(nucleus mass)`` per token, and the
  importance weights of decoupled PPO see that as off-policyness. Greedy (temperature 0)
  reports log-probabilities at temperature 1, as ``HFEngine`` does.
- Stopping. Only ``SamplingParams.stop_token_ids`` end a completion (``ignore_eos=True``), as in
  ``HFEngine``; the stop token is part of the completion. Model-file sampling defaults
  (``generation_config.json``) are ignored (``generation_config="vllm"``).
- Token ids only: ``skip_tokenizer_init=True`` and ``detokenize=False``.
- Weight updates. ``update_weights`` runs the model's own ``load_weights`` (which maps Hugging
  Face names onto vLLM's fused layers, e.g. q/k/v into qkv_proj) inside the worker through
  ``LLM.apply_model``, then resets the prefix cache: cached KV blocks were computed by the old
  weights, and a next-turn prompt that extends an earlier one would otherwise reuse them. The
  parameters are copied in place, so CUDA graphs stay valid.
- One GPU, in process. The constructor sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the
  caller set it: the engine core then runs in this process and ``apply_model`` hands the
  tensors over without serialising them. With multiprocessing forced on, vLLM needs
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to ship the loader function, and the tensors are
  moved to CPU first. Tensor parallelism is not supported.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from turnrl.rollout.engine import Completion, SamplingParams

MISSING_VLLM = ("VLLMEngine needs vLLM and a CUDA GPU; install it with "
                "`pip install 'turnrl[vllm]'` on a GPU machine")
LOGPROBS_MODE = "processed_logprobs"
_IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"

WeightsLike = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_tensors(weights: WeightsLike, to_cpu: bool = False) -> list[tuple[str, torch.Tensor]]:
    """``(name, detached tensor)`` pairs from a state dict or an iterable of pairs."""
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    out = []
    for name, tensor in pairs:
        tensor = tensor.detach()
        out.append((name, tensor.cpu() if to_cpu else tensor))
    return out


def _load_into_model(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside the vLLM worker; returns nothing so no result crosses back."""
    model.load_weights(weights)


def to_completion(output: Any) -> Completion:
    """A turnrl ``Completion`` from one vLLM ``CompletionOutput`` (requested with logprobs=0)."""
    token_ids = [int(t) for t in output.token_ids]
    if output.logprobs is None or len(output.logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no per-token log-probabilities; "
                           "the request must set logprobs=0")
    logprobs = [float(step[token].logprob) for token, step in zip(token_ids, output.logprobs,
                                                                   strict=True)]
    if output.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request finished with {output.finish_reason!r}")
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=output.finish_reason)


class VLLMEngine:
    """Samples with vLLM's offline ``LLM`` from token ids; implements the ``Engine`` protocol.

    ``model_path`` is a local Hugging Face model directory (for the built-in models, load them
    with ``turnrl.models.load_model`` and ``save_pretrained`` them first). ``llm_kwargs`` go to
    ``vllm.LLM`` unchanged and override the defaults set here.
    """

    def __init__(self, model_path: str | os.PathLike, *, seed: int = 0, dtype: str = "auto",
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
                 enforce_eager: bool = False, version: int = 0,
                 keep_cache_across_versions: bool = False, **llm_kwargs: Any):
        try:
            import vllm
            from vllm.inputs import TokensPrompt
        except ImportError as exc:
            raise ImportError(MISSING_VLLM) from exc
        os.environ.setdefault(_IN_PROCESS_ENV, "0")
        self._in_process = os.environ[_IN_PROCESS_ENV] == "0"
        self._sampling_params_cls = vllm.SamplingParams
        self._tokens_prompt = TokensPrompt
        self.version = version
        self.keep_cache_across_versions = keep_cache_across_versions
        """Keep the prefix cache across ``update_weights`` (as ``HFEngine``'s flag)."""
        kwargs: dict[str, Any] = {
            "model": os.fspath(model_path),
            "seed": seed,
            "dtype": dtype,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enforce_eager": enforce_eager,
            "tensor_parallel_size": 1,
            "skip_tokenizer_init": True,
            "generation_config": "vllm",
            "logprobs_mode": LOGPROBS_MODE,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs.update(llm_kwargs)
        try:
            self.llm = vllm.LLM(**kwargs)
        except (TypeError, ValueError) as exc:
            if "logprobs_mode" in str(exc):
                raise RuntimeError(
                    f"vLLM {getattr(vllm, '__version__', '?')} cannot report temperature-scaled "
                    f"log-probabilities (logprobs_mode={LOGPROBS_MODE!r}); install vllm>=0.10.2"
                ) from exc
            raise

    def _vllm_params(self, params: SamplingParams) -> Any:
        return self._sampling_params_cls(
            n=1,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,
            logprobs=0,  # the sampled token's log-probability only
            detokenize=False,
        )

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        if not prompts:
            return []
        if params.max_new_tokens < 1:  # vLLM rejects max_tokens=0; HFEngine samples nothing
            return [Completion() for _ in prompts]
        requests = [self._tokens_prompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        outputs = self.llm.generate(requests, self._vllm_params(params), use_tqdm=False)
        return [to_completion(out.outputs[0]) for out in outputs]

    def update_weights(self, weights: WeightsLike, version: int) -> None:
        """Copy the learner's weights (a state dict, or ``(name, tensor)`` pairs with Hugging
        Face names) into the vLLM model in place, then adopt ``version``. The prefix cache
        (keys and values of the old weights) is dropped unless ``keep_cache_across_versions``
        (PipelineRL's in-flight update)."""
        pairs = named_tensors(weights, to_cpu=not self._in_process)
        if not pairs:
            raise ValueError("update_weights got no tensors")
        load = functools.partial(_load_into_model, weights=pairs)
        if hasattr(self.llm, "apply_model"):
            self.llm.apply_model(load)
        else:  # older single-GPU engines expose the model directly
            load(self.llm.llm_engine.model_executor.driver_worker.model_runner.model)
        stale = not self.keep_cache_across_versions and hasattr(self.llm, "reset_prefix_cache")
        if stale and self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM could not reset its prefix cache after the weight update")
        self.version = version
