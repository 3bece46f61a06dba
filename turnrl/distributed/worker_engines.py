"""What a rollout worker is built from besides its engine (built by
``turnrl.samplers.chooser.for_run``): the chat side of the policy a vLLM worker needs, the
background conversion a ct2 worker refreshes with, its env (with the opponent it builds), its sampling seed,
and the published state dict's tied tensors (dropped before publishing, restored on
receipt). Used by ``RolloutWorker`` (workers.py), which imports them from here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from turnrl.config import Config
from turnrl.distributed.weight_sync import TIED_KEYS
from turnrl.envs.base import Env, make_env
from turnrl.models import model_directory
from turnrl.policy import env_factories, load_policy, use_chat_template
from turnrl.rollout import ChatFormat
from turnrl.selfplay.endpoint import EndpointOpponent
from turnrl.selfplay.opponents import ModelOpponent, attach_player
from turnrl.selfplay.pool import OpponentPool, PoolDraw, pool_wait_s


@dataclass
class Player:
    """What a vLLM worker needs besides vLLM: the chat format and the context length (and,
    for the tiny model only, the model itself, to save it where vLLM can load it)."""

    tokenizer: Any
    chat: ChatFormat
    max_context: int | None
    model: Any = None


def load_player(cfg: Config) -> Player:
    """The chat side of the policy without its weights (vLLM loads its own copy on the GPU);
    the same chat-template and environment checks as ``load_policy``."""
    from transformers import AutoConfig, AutoTokenizer

    path = model_directory(cfg.model.name, cfg.model.cache_dir or None, cfg.model.revision)
    if path is None:  # tiny: built in code, nothing to load it from
        policy = load_policy(replace(cfg, model=replace(cfg.model, device="cpu")), announce=False)
        return Player(policy.tokenizer, policy.chat, policy.max_context, policy.model)
    trust = cfg.model.trust_remote_code
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    use_chat_template(tokenizer, cfg.model.chat_template)
    chat = ChatFormat(tokenizer)
    chat.check()
    env_factories(cfg)  # the env (a mix's entries, a curriculum's levels) builds
    max_context = getattr(AutoConfig.from_pretrained(path, trust_remote_code=trust),
                          "max_position_embeddings", None)
    return Player(tokenizer, chat, max_context)


def worker_env_factory(cfg: Config, pool: OpponentPool | None = None, name: str | None = None,
                       options: dict[str, Any] | None = None,
                       players: dict[str, Any] | None = None) -> Callable[[], Env]:
    """The worker's env (``name`` and ``options``: default ``env.name``'s and
    ``env.options``): a multi-seat game's seats are all played by the worker's own engine
    (self-play); an outside opponent the worker can build itself (another local model, an
    endpoint: frozen, the same in every worker; built once per ``players``, which the envs of
    a mix or a curriculum share) is handed to each new env; a pool opponent is drawn from
    ``pool``, the worker's copy of the learner's (``set_pool``), when the game first needs it
    (the learner sends the pool with the weights, before any work), waiting for it less than
    the env call it is drawn in lasts (``pool_wait_s``)."""
    options = cfg.env.options if options is None else options
    make = partial(make_env, name or cfg.env.name, **options)
    opponent = options.get("opponent")
    players = {} if players is None else players
    if opponent == "pool" and pool is not None:
        wait_s = pool_wait_s(cfg.rollout.env_timeout_s)
        return attach_player(make, partial(PoolDraw, pool, wait_s))
    if opponent == "model":
        if opponent not in players:
            players[opponent] = ModelOpponent.load(cfg.env.opponent_model, cfg)
        return players[opponent].attach(make)
    if opponent == "endpoint":
        if opponent not in players:
            players[opponent] = EndpointOpponent.from_config(cfg)
        return players[opponent].attach(make)
    return make


def planned_env_factories(cfg: Config, pool: OpponentPool | None = None,
                          players: dict[str, Any] | None = None
                          ) -> tuple[list[Callable[[], Env]], list[Callable[[], Env]]]:
    """(each ``env.mix`` entry's env, each ``env.curriculum`` level's env) as the worker
    builds them: the learner names one of either in each assignment (``GroupPlan``)."""
    players = {} if players is None else players
    entries = [worker_env_factory(cfg, pool, e.name, e.options, players)
               for e in cfg.env.mix_plan()]
    plan = cfg.env.curriculum_plan()
    levels = [worker_env_factory(cfg, pool, cfg.env.name, {**cfg.env.options, plan.option: v},
                                 players) for v in plan.levels] if plan else []
    return entries, levels


def sampling_seed(run_seed: int, worker: int) -> int:
    """Seed of a worker's sampling generator. Worker 0 draws the same random numbers as the
    sync trainer's engine (seeded with ``run.seed``), so sync and async runs of one seed
    draw from common random numbers (one group from the same weights is sampled alike; with
    several in flight the worker batches rows differently and the draws land elsewhere).
    With other seeds, one run of each compares two sampling streams, and at a few updates
    the stream decides more than the mode (SmolLM2, 8 steps of guess-number, the sync loop alone:
    26.6% held-out success with one stream, 71.9% with another)."""
    return run_seed if worker == 0 else run_seed * 1009 + 17 * worker


def ct2_refresh(cfg: Config, engine: Any, index: int) -> Any:
    """The ``BackgroundRefresh`` that converts each version sent to worker ``index``'s
    ``CT2Engine`` while it samples."""
    from turnrl.samplers.ct2_refresh import BackgroundRefresh

    return BackgroundRefresh(engine, cfg.rollout.temperature, fetched_state,
                             name=f"ct2-refresh-{index}")


def fetched_state(sent: Any) -> dict[str, torch.Tensor]:
    """The state dict ``set_weights`` was sent: ``[ObjectRef]`` read from the object store
    (only when it is used), or a state dict; tied tensors restored."""
    if isinstance(sent, list):
        import ray

        sent = ray.get(sent[0])
    return with_tied_weights(sent)


def without_tied_weights(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``state`` with tensors that share storage with an earlier one (a tied lm_head and
    embedding: a fifth of SmolLM2-135M) kept once, so each publication ships less."""
    kept: dict[str, Any] = {}
    first_key: dict[tuple[int, tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    for key, tensor in state.items():
        identity = (tensor.data_ptr(), tuple(tensor.shape))
        if identity in first_key:
            aliases[key] = first_key[identity]
        else:
            first_key[identity] = key
            kept[key] = tensor
    kept[TIED_KEYS] = aliases
    return kept


def with_tied_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inverse of ``without_tied_weights`` (a plain state dict passes through)."""
    state = dict(state)
    for key, original in state.pop(TIED_KEYS, {}).items():
        state[key] = state[original]
    return state
