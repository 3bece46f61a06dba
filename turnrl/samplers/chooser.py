"""The one constructor of every sampler, and the ``sampler:`` line each prints with who it
samples for.

``for_run`` turns ``rollout.sampler``, ``rollout.sampler_dtype`` and the ``sampler`` section
into an engine, for the lock-step learner, the server, guidance and Ray rollout workers
(hf, ct2 and vLLM alike; ``turnrl.policy.sampler`` times ``auto``'s candidates, each built
here); ``build`` makes one by name (``FACTORIES``), for a caller that picks it itself (the
self-play opponents' HF engine on a frozen copy).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from turnrl.config import Config
from turnrl.lora import base_copy, vllm_lora_config
from turnrl.models import model_directory
from turnrl.samplers.base import Sampler, describe_sampler
from turnrl.samplers.hf import HFEngine
from turnrl.samplers.model_dirs import remove_with, save_model_dir


def sampler_line(engine: object, who: str = "") -> str:
    """``sampler: hf float32 on cpu (lean pass) (opponent pool-v3)``."""
    return describe_sampler(engine) + (f" ({who})" if who else "")


def choice(cfg: Config, who: str = "learner", *, worker: bool = False) -> tuple[str, str]:
    """(sampler, dtype) for ``who``: ``rollout.sampler`` and its dtype, in every mode; the
    async learner only evaluates (its rollout workers sample), with the HF engine on its own
    tensors when the workers' sampler is another. vLLM's ``auto`` dtype: the model's in the
    learner's process, bfloat16 on a rollout ``worker``'s GPU (FlashAttention needs 16-bit
    weights) whatever the learner trains in."""
    if cfg.run.mode == "async" and who == "learner" and cfg.rollout.sampler != "hf":
        return "hf", "auto"
    name, dtype = cfg.rollout.sampler, cfg.rollout.sampler_dtype
    if name == "vllm" and dtype == "auto":
        dtype = "bfloat16" if worker else cfg.model.dtype
    return name, dtype


def named_for(cfg: Config, who: str) -> str:
    """Who the ``sampler:`` line names: nobody for the learner (the line of a plain run),
    where the async learner's sampler is not its workers' theirs too, else ``who``."""
    if choice(cfg, who)[0] != cfg.rollout.sampler:
        return f"{who}'s evaluation; rollout workers: {cfg.rollout.sampler}"
    return "" if who == "learner" else who


def for_run(cfg: Config, model: torch.nn.Module | None, tokenizer: Any, *, who: str = "learner",
            pick: tuple[str, str] | None = None, seed: int | None = None, version: int = 0,
            worker: bool = False, max_context: int | None = None) -> Sampler:
    """The engine ``pick`` (default: ``choice`` for ``who``; never ``auto``, which
    ``turnrl.policy.sampler`` times) names, with the ``sampler`` section's options, seeded
    with ``seed`` (default ``run.seed``) and at ``version``. ``model`` None: vLLM loads the
    model's directory (a rollout worker with no CPU copy of the weights); ``max_context``
    defaults to the model's."""
    name, dtype = pick or choice(cfg, who, worker=worker)
    options: dict[str, Any] = {}
    if name == "hf":
        options = dict(reuse_cache=cfg.sampler.reuse_cache, matmul=cfg.sampler.matmul)
    elif name == "ct2":
        options = dict(version=version)
    elif name == "vllm":
        if max_context is None and model is not None:
            max_context = getattr(model.config, "max_position_embeddings", None)
        options = dict(version=version, tokenizer=tokenizer, label=who.replace(" ", "-"),
                       model_dir=model_directory(cfg.model.name, cfg.model.cache_dir or None,
                                                 cfg.model.revision),
                       gpu_memory_utilization=cfg.sampler.gpu_memory_utilization,
                       max_model_len=max_context,
                       lora_config=vllm_lora_config(cfg.model.lora_plan()))
    return build(name, dtype, model, tokenizer.pad_token_id,
                 seed=cfg.run.seed if seed is None else seed, **options)


def build(name: str, dtype: str, model: torch.nn.Module | None, pad_token_id: int, *, seed: int,
          who: str = "", announce: bool = False, **options) -> Sampler:
    """The ``FACTORIES`` engine ``name`` in ``dtype`` on ``model``, with its ``options``;
    ``announce``: print the ``sampler:`` line naming ``who``."""
    if name not in FACTORIES:
        raise ValueError(f"no sampler {name!r}: one of {sorted(FACTORIES)}")
    engine = FACTORIES[name](dtype, model, pad_token_id, seed=seed, **options)
    if announce:
        print(sampler_line(engine, who), flush=True)
    return engine


def hf_engine(dtype: str, model: torch.nn.Module, pad_token_id: int, *, seed: int,
              own_copy: bool = False, **options) -> Sampler:
    """The HF engine on the model's own tensors (``dtype`` auto or the model's) or on a copy
    in ``dtype`` (``own_copy``: a copy in any dtype, for a learner whose weights become FSDP
    shards); ``options`` are its own (matmul, reuse_cache, ...)."""
    if own_copy or getattr(torch, dtype, model.dtype) != model.dtype:
        from turnrl.samplers.copy import HFCopyEngine

        return HFCopyEngine(model, getattr(torch, dtype), pad_token_id, seed=seed, **options)
    return HFEngine(model, pad_token_id, seed=seed, **options)


def ct2_engine(dtype: str, model: torch.nn.Module, pad_token_id: int, *, seed: int,
               version: int = 0) -> Sampler:
    """CTranslate2 converting ``model`` (its architecture, then each version's weights);
    ``dtype`` is its compute type (auto: int8)."""
    from turnrl.samplers.ct2 import CT2Engine

    return CT2Engine(model, compute_type=dtype, seed=seed, version=version)


def vllm_engine(dtype: str, model: torch.nn.Module | None, pad_token_id: int, *, seed: int,
                model_dir: Path | None = None, tokenizer: Any = None, label: str = "learner",
                **options) -> Sampler:
    """A ``VLLMEngine`` on ``model_dir``, or, where there is none (the tiny model, built in
    code), on ``model`` and ``tokenizer`` saved to a temporary directory first, removed with
    the engine (``model_dir_cleanup``: at its collection, a worker's ``stop`` or the process's
    exit; turnrl/samplers/model_dirs.py). New versions reach it through ``load`` (vLLM's own
    loader, in place); it draws other random numbers than the HF engine does."""
    from turnrl.samplers.vllm import VLLMEngine

    path = model_dir or save_model_dir(label, partial(_save_model, model, tokenizer))
    try:
        engine = VLLMEngine(path, seed=seed, dtype=dtype, **options)
    except BaseException:
        if model_dir is None:
            shutil.rmtree(path, ignore_errors=True)
        raise
    if model_dir is None:
        engine.model_dir_cleanup = remove_with(engine, path)
    return engine


def _save_model(model: torch.nn.Module, tokenizer: Any, path: Path) -> None:
    base_copy(model).save_pretrained(path)  # LoRA: the base; the adapter comes per version
    tokenizer.save_pretrained(path)


FACTORIES: dict[str, Callable[..., Sampler]] = {
    "hf": hf_engine, "ct2": ct2_engine, "vllm": vllm_engine}
"""``rollout.sampler`` -> the factory that builds it (``auto`` picks among these); each
entry of ``turnrl.samplers.catalog.SAMPLERS`` names its own."""
