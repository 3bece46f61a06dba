"""The policy and what plays it, as every mode builds it: model, chat format, engine, seeds.

Trainer-free on purpose: the sync trainer, the async learner, the Ray rollout workers and
``turnrl eval`` all load the policy here, so each of them checks the chat template and the
environment the same way at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from turnrl.config import Config
from turnrl.envs import Env, make_env
from turnrl.envs.contract import uses_pool
from turnrl.envs.mix import MixEnv
from turnrl.envs.user_module import load_env_module
from turnrl.learner.weights import published_pairs, published_state, sharded
from turnrl.lora import add_adapter, require_peft
from turnrl.models import load_model, resolve_device
from turnrl.rollout import ChatFormat
from turnrl.rollout.chat import (
    checked_chat,
    read_chat_template,
    sampling_params,
)
from turnrl.samplers import SamplingParams, chooser
from turnrl.samplers.base import Engine
from turnrl.samplers.hf import HFEngine
from turnrl.selfplay.evaluation import evaluation_factories


@dataclass
class Policy:
    """The model and everything that plays it."""

    model: torch.nn.Module
    tokenizer: object
    chat: ChatFormat
    engine: Engine
    """``HFEngine`` (samples from ``model`` itself, or ``HFCopyEngine`` from a copy in
    ``rollout.sampler_dtype``), ``VLLMEngine`` or ``CT2Engine`` (``rollout.sampler``; in
    async mode the learner's own is hf: ``chooser.choice``)"""
    max_context: int | None
    make_env: Callable[[], Env]
    """The env training plays (a mix: ``MixEnv``; a curriculum: its hardest level, which the
    trainer's ``TrainingEnvs`` replaces by the current one)."""
    params: SamplingParams
    """Training-time sampling (``rollout.*``)."""
    eval_envs: dict[str, Callable[[], Env]]
    """label -> the env held-out evaluation plays (``env_factories``; played by
    ``trainer/evaluation.py``)."""


def load_policy(cfg: Config, announce: bool = True, who: str = "learner") -> Policy:
    """Load the model on its device (with a fresh LoRA adapter under ``model.lora``), check
    its chat template, the env and the envs evaluation plays; print the ``sampler:`` line
    (naming ``who``) unless the caller replaces the sampler (``announce`` False) and prints
    its own."""
    load_env_module(cfg.env.module)  # the user's envs, before any is built
    model, tokenizer = policy_model(cfg)
    # Fails at start-up, not mid-run, if the template breaks token-in-token-out.
    chat = checked_chat(tokenizer, cfg.model.chat_template)
    make, eval_makes = env_factories(cfg)  # bad names or options fail here, in one line
    engine = sampler(cfg, model, tokenizer, who)
    if announce:
        print(chooser.sampler_line(engine, chooser.named_for(cfg, who)), flush=True)
    max_context = getattr(model.config, "max_position_embeddings", None)
    return Policy(model, tokenizer, chat, engine, max_context, make, sampling_params(cfg, chat),
                  eval_makes)


def policy_model(cfg: Config, device: torch.device | str | None = None
                 ) -> tuple[torch.nn.Module, object]:
    """The policy's model (with a fresh LoRA adapter under ``model.lora``) on ``device``
    (None: ``model.device``'s), and its tokenizer."""
    lora = cfg.model.lora_plan()
    if lora is not None:
        require_peft()  # before the model loads: one line, not a traceback minutes later
    model, tokenizer = load_model(cfg.model.name, dtype=cfg.model.dtype,
                                  cache_dir=cfg.model.cache_dir or None,
                                  revision=cfg.model.revision,
                                  trust_remote_code=cfg.model.trust_remote_code)
    model.to(device or resolve_device(cfg.model.device))
    if lora is not None:
        model = add_adapter(model, lora)
    return model, tokenizer


def publish(engine: Engine, model: torch.nn.Module, version: int) -> None:
    """The one path new weights take to a sampler (every source, serve, checkpoint
    evaluation, the ``auto`` probe): an HF engine on ``model``'s own tensors reloads them where
    they are; any other engine (a copy, ct2, vLLM) gets ``published_state``: LoRA-aware, the
    adapter alone for a LoRA model (vLLM loads it as an adapter), every weight otherwise."""
    if getattr(engine, "model", None) is model:
        engine.load(None, version)
    elif sharded(model) and isinstance(engine, HFEngine):  # shards gathered one at a time
        engine.load(published_pairs(model), version)
    else:
        engine.load(published_state(model), version)


def sampler(cfg: Config, model: torch.nn.Module, tokenizer, who: str = "learner") -> Engine:
    """The engine ``rollout.sampler`` and its dtype name for ``who`` (``chooser.for_run``, the
    one constructor of every mode): the HF engine on the learner's own tensors (or on a copy
    in another dtype), vLLM, CTranslate2, or the fastest of those this machine has (auto)."""
    if chooser.choice(cfg, who)[0] == "auto":
        return fastest_sampler(cfg, model, tokenizer)
    return chooser.for_run(cfg, model, tokenizer, who=who)


def sampler_candidates(cfg: Config, model: torch.nn.Module) -> list[tuple[str, str]]:
    """``(sampler, sampler_dtype)`` pairs this machine can run for ``rollout.sampler auto``: the
    HF engine in the model's dtype always; CTranslate2 int8 where the ct2 extra is installed
    and converts the model; the HF engine on a bf16 copy where the CPU has native bf16."""
    from turnrl.config.checks import samples_on_cpu
    from turnrl.config.precision import cpu_has_bf16
    from turnrl.samplers.ct2 import check_architecture

    candidates = [("hf", "auto")]
    if not samples_on_cpu(cfg.model.device):
        return candidates  # a GPU: the HF engine (vllm is chosen by name)
    try:
        check_architecture(model.config)
        candidates.append(("ct2", "int8"))
    except (ImportError, ValueError):
        pass
    if cpu_has_bf16() and model.dtype != torch.bfloat16:
        candidates.append(("hf", "bfloat16"))
    return candidates


def fastest_sampler(cfg: Config, model: torch.nn.Module, tokenizer) -> Engine:
    """``rollout.sampler auto``: every candidate timed on the run's batch shape, sampling and
    one weight refresh each, and the one whose estimated step (sampling scaled to the step's
    rows, turns and new tokens, plus the refresh every lock-step step pays) is cheapest kept
    (``turnrl.samplers.choice``); the choice and the figures printed in one line."""
    from turnrl.samplers import choice as engine_choice

    candidates = sampler_candidates(cfg, model)
    label = {pair: f"{pair[0]} {model_dtype_name(model) if pair[1] == 'auto' else pair[1]}"
             for pair in candidates}
    if len(candidates) == 1:
        print(f"rollout.sampler auto: {label[candidates[0]]} (the only sampler this machine has)")
        return chooser.for_run(cfg, model, tokenizer, pick=candidates[0])
    rollout = cfg.rollout
    step = engine_choice.Shape(rollout.group_size * rollout.groups_per_step,
                               rollout.max_turns, rollout.max_new_tokens)
    probe = engine_choice.probe_shape(step.rows, step.new_tokens)
    builders = {label[pair]: partial(chooser.for_run, cfg, model, tokenizer, pick=pair)
                for pair in candidates}
    was_training = model.training
    engines, timings = engine_choice.time_engines(
        builders, lambda engine, version: publish(engine, model, version), probe,
        int(model.config.vocab_size))
    model.train(was_training)
    chosen = engine_choice.pick_fastest(timings.step_s(probe, step),
                                        default=label[candidates[0]])
    print(engine_choice.describe(chosen, timings, probe, step))
    engine = engines.pop(chosen)
    for other in engines.values():
        getattr(other, "close", lambda: None)()
    engine.generator.manual_seed(cfg.run.seed)  # the run's draws start where they would have
    publish(engine, model, 0)  # forgets the probe's kept keys and values
    return engine


def model_dtype_name(model: torch.nn.Module) -> str:
    return str(model.dtype).removeprefix("torch.")


def level_factory(cfg: Config, value: Any) -> Callable[[], Env]:
    """The env with ``env.curriculum``'s option at ``value``."""
    option = cfg.env.curriculum_plan().option
    return partial(make_env, cfg.env.name, **{**cfg.env.options, option: value})


def env_factories(cfg: Config) -> tuple[Callable[[], Env], dict[str, Callable[[], Env]]]:
    """(the env training plays, label -> the env(s) evaluation plays), each built once here so
    an unknown env or a bad option fails at start-up with one line naming the config key.

    A curriculum evaluates at its hardest level (fixed, so before and after compare); a mix
    evaluates each of its envs (a self-play entry against each of its fixed opponents,
    ``LABEL@OPPONENT``, as it would alone)."""
    curriculum, mix = cfg.env.curriculum_plan(), cfg.env.mix_plan()
    if mix:
        makes = [_checked(f"env.mix[{i}]", partial(make_env, e.name, **e.options))
                 for i, e in enumerate(mix)]
        train = partial(MixEnv, makes, [e.weight for e in mix], cfg.run.seed,
                        [e.name for e in mix], [uses_pool(e.options) for e in mix])
        evaluated = {}
        for entry, make in zip(mix, makes, strict=True):  # a self-play game: its fixed opponents
            for label, factory in evaluation_factories(entry.name, entry.options, make()).items():
                evaluated[entry.label + label.removeprefix(entry.name)] = factory
        return train, evaluated
    if curriculum:
        for i, value in enumerate(curriculum.levels):
            _checked(f"env.curriculum level {i} ({curriculum.option}={value!r})",
                     level_factory(cfg, value))
        hardest = level_factory(cfg, curriculum.levels[-1])
        return hardest, {cfg.env.name: hardest}
    make = partial(make_env, cfg.env.name, **cfg.env.options)
    env = make()
    evaluated = evaluation_factories(cfg.env.name, cfg.env.options, env)
    for label, factory in evaluated.items():
        _checked(f"evaluation env {label}", factory)
    return make, evaluated


def _checked(where: str, make: Callable[[], Env]) -> Callable[[], Env]:
    """``make`` once it has built an env; its one-line error prefixed with ``where``."""
    try:
        make()
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return make


def use_chat_template(tokenizer, path: str) -> None:
    """Replace the tokenizer's chat template with the file ``path`` ('' keeps it)."""
    if path:  # a file that is unreadable, empty, binary or not Jinja: one line naming it
        tokenizer.chat_template = read_chat_template(path)


def training_seeds(cfg: Config, step: int) -> list[tuple[int, int]]:
    """(env seed, group id) per episode of ``step``: each group replays one seed.

    Seeds stay below ``eval.seed_offset``, so training never sees a held-out task.
    """
    groups = cfg.rollout.groups_per_step
    base = (cfg.run.seed * 7919 + step * groups) % cfg.eval.seed_offset
    return [((base + g) % cfg.eval.seed_offset, g)
            for g in range(groups) for _ in range(cfg.rollout.group_size)]


def group_seed(cfg: Config, index: int) -> int:
    """Seed of the ``index``-th group handed out in async mode: the seeds sync would play."""
    step, group = divmod(index, cfg.rollout.groups_per_step)
    return training_seeds(cfg, step)[group * cfg.rollout.group_size][0]
