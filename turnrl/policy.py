"""The policy and what plays it, as every mode builds it: model, chat format, engine, seeds.

Trainer-free on purpose: the sync trainer, the async learner, the Ray rollout workers and
``turnrl eval`` all load the policy here, so each of them checks the chat template and the
environment the same way at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from turnrl.config import Config
from turnrl.envs import Env, make_env
from turnrl.envs.mix import MixEnv
from turnrl.evaluation import EvalResult, evaluate, evaluate_each, reply_scorer, with_env_metrics
from turnrl.models import load_model, resolve_device
from turnrl.rollout import ChatFormat, HFEngine, SamplingParams
from turnrl.rollout.engine import Engine


@dataclass
class Policy:
    """The model and everything that plays it."""

    model: torch.nn.Module
    tokenizer: object
    chat: ChatFormat
    engine: Engine
    """``HFEngine`` (samples from ``model`` itself) or ``VLLMEngine`` (``rollout.engine``)"""
    max_context: int | None
    make_env: Callable[[], Env]
    """The env training plays (a mix: ``MixEnv``; a curriculum: its hardest level, which the
    trainer's ``TrainingEnvs`` replaces by the current one)."""
    params: SamplingParams
    """Training-time sampling (``rollout.*``)."""
    run_eval: Callable[[], tuple[EvalResult, list]]
    """Plays the held-out seeds ``eval.seed_offset ...`` once with the current weights."""


def sampling_params(cfg: Config, chat: ChatFormat, temperature: float | None = None
                    ) -> SamplingParams:
    temperature = cfg.rollout.temperature if temperature is None else temperature
    return SamplingParams(cfg.rollout.max_new_tokens, temperature, cfg.rollout.top_p,
                          stop_token_ids=(chat.end_of_turn,))


def load_policy(cfg: Config) -> Policy:
    """Load the model on its device, check its chat template and the env, wire evaluation."""
    model, tokenizer = load_model(cfg.model.name, dtype=cfg.model.dtype,
                                  cache_dir=cfg.model.cache_dir or None,
                                  revision=cfg.model.revision,
                                  trust_remote_code=cfg.model.trust_remote_code)
    model.to(resolve_device(cfg.model.device))
    use_chat_template(tokenizer, cfg.model.chat_template)
    chat = ChatFormat(tokenizer)
    chat.check()  # fail at start-up, not mid-run, if the template breaks token-in-token-out
    make, eval_makes = env_factories(cfg)  # bad names or options fail here, in one line
    if cfg.rollout.engine == "vllm":
        engine = vllm_sampler(cfg, model, tokenizer)
    else:
        engine = HFEngine(model, tokenizer.pad_token_id, seed=cfg.run.seed,
                          reuse_cache=cfg.rollout.reuse_cache)
    eval_seeds = list(range(cfg.eval.seed_offset, cfg.eval.seed_offset + cfg.eval.episodes))
    max_context = getattr(model.config, "max_position_embeddings", None)
    eval_params = sampling_params(cfg, chat, cfg.eval.temperature)
    options = dict(max_turns=cfg.rollout.max_turns, env_timeout_s=cfg.rollout.env_timeout_s,
                   max_context=max_context)
    if len(eval_makes) > 1:  # a mix: each env on the held-out seeds, a row each
        play_eval = partial(evaluate_each, eval_makes, eval_seeds, engine, chat, eval_params,
                            **options)
    else:
        play_eval = partial(evaluate, next(iter(eval_makes.values())), eval_seeds, engine, chat,
                            eval_params, env_name=cfg.env.name, **options)
    score = reply_scorer(model, chat, cfg.rollout.temperature)  # the policy as it samples

    def run_eval() -> tuple[EvalResult, list]:
        result, episodes = play_eval()
        return with_env_metrics(result, next(iter(eval_makes.values()))(), score), episodes

    return Policy(model, tokenizer, chat, engine, max_context, make, sampling_params(cfg, chat),
                  run_eval)


def vllm_sampler(cfg: Config, model: torch.nn.Module, tokenizer) -> Engine:
    """A ``VLLMEngine`` on the model's directory (the tiny model, built in code, is saved to
    a temporary one first), in ``rollout.engine_dtype``; new versions reach it through
    ``update_weights`` (``LocalSource.publish``)."""
    import tempfile

    from turnrl.models import model_directory
    from turnrl.rollout.vllm_engine import VLLMEngine

    path = model_directory(cfg.model.name, cfg.model.cache_dir or None)
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="turnrl-vllm-sync-"))
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    dtype = cfg.model.dtype if cfg.rollout.engine_dtype == "auto" else cfg.rollout.engine_dtype
    return VLLMEngine(path, seed=cfg.run.seed, dtype=dtype,
                      max_model_len=getattr(model.config, "max_position_embeddings", None))


def level_factory(cfg: Config, value: Any) -> Callable[[], Env]:
    """The env with ``env.curriculum``'s option at ``value``."""
    option = cfg.env.curriculum_plan().option
    return partial(make_env, cfg.env.name, **{**cfg.env.options, option: value})


def env_factories(cfg: Config) -> tuple[Callable[[], Env], dict[str, Callable[[], Env]]]:
    """(the env training plays, label -> the env(s) evaluation plays), each built once here so
    an unknown env or a bad option fails at start-up with one line naming the config key.

    A curriculum evaluates at its hardest level (fixed, so before and after compare); a mix
    evaluates each of its envs."""
    curriculum, mix = cfg.env.curriculum_plan(), cfg.env.mix_plan()
    if mix:
        makes = {e.label: _checked(f"env.mix[{i}]", partial(make_env, e.name, **e.options))
                 for i, e in enumerate(mix)}
        train = partial(MixEnv, list(makes.values()), [e.weight for e in mix], cfg.run.seed,
                        [e.name for e in mix])
        return train, makes
    if curriculum:
        for i, value in enumerate(curriculum.levels):
            _checked(f"env.curriculum level {i} ({curriculum.option}={value!r})",
                     level_factory(cfg, value))
        hardest = level_factory(cfg, curriculum.levels[-1])
        return hardest, {cfg.env.name: hardest}
    make = partial(make_env, cfg.env.name, **cfg.env.options)
    make()
    return make, {cfg.env.name: make}


def _checked(where: str, make: Callable[[], Env]) -> Callable[[], Env]:
    """``make`` once it has built an env; its one-line error prefixed with ``where``."""
    try:
        make()
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return make


def use_chat_template(tokenizer, path: str) -> None:
    """Replace the tokenizer's chat template with the file ``path`` ('' keeps it)."""
    if path:
        tokenizer.chat_template = Path(path).expanduser().read_text()


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
