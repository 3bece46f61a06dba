"""The players a two-seat game's other seat can hold, and how each reaches its game.

``FrozenPolicy`` is a frozen copy of a policy (a pool member, pool.py, or another local
model): its moves are sampled on an ``HFEngine`` of its own, the moves asked for together in
one batch (batched_calls.py), each game on a random stream of its own. ``PoolPlayer`` is one
game's pool opponent; ``ModelOpponent`` (``opponent: model``) gives each game a
``GameStream`` of one frozen model, seeded when the env resets. ``attach_player`` hands a
player to each new env (the env's ``set_opponent``); the endpoint opponent is endpoint.py's.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

import torch

from turnrl.envs import Env
from turnrl.rollout import ChatFormat
from turnrl.samplers import SamplingParams, chooser
from turnrl.selfplay.batched_calls import MAX_BATCH, BatchedCalls


class FrozenPolicy:
    """A past policy, frozen: ``act(system_prompt, observation)`` is its reply to a
    one-message chat (the game's whole state is in the observation). Safe to call from several env threads: the moves asked for together are
    generated in one batch (``BatchedCalls``; ``max_batch`` 1: one at a time), each on its
    game's own random stream, so a game's replies do not depend on its batch."""

    def __init__(self, model: torch.nn.Module, chat: ChatFormat, params: SamplingParams,
                 version: int, seed: int = 0, *, label: str = "",
                 max_batch: int = MAX_BATCH) -> None:
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.chat, self.params, self.version = chat, params, version
        self.label = label
        # the HF engine on its own frozen copy (a pool member must not convert per version);
        # no cache across calls: the seats' moves interleave
        self.engine = chooser.build("hf", "auto", self.model, chat.tokenizer.pad_token_id,
                                    seed=seed + version, reuse_cache=False, announce=True,
                                    who=f"opponent {self.name}")
        self.moves = BatchedCalls(self._generate, name=f"opponent {self.name}",
                                  max_batch=max_batch)

    @property
    def name(self) -> str:
        """What episodes record as their ``opponent``."""
        return self.label or f"pool-v{self.version}"

    def act(self, system_prompt: str | None, observation: str,
            generator: torch.Generator | None = None) -> str:
        """The reply, sampled on ``generator`` (a game's own stream) or the engine's own."""
        _, _, ids = self.chat.start(observation, system_prompt)
        completion = self.moves.call((ids, generator))
        tokens = completion.token_ids
        if completion.finish_reason == "stop":
            tokens = tokens[:-1]
        return self.chat.tokenizer.decode(tokens)

    def _generate(self, requests: list[tuple[list[int], torch.Generator | None]]) -> list:
        """One batch of moves: each prompt's completion, drawn on its own stream."""
        prompts, generators = zip(*requests, strict=True)
        return self.engine.generate(prompts, self.params, generators=generators)


class PoolPlayer:
    """One game's pool opponent: a member and the game's own sampling stream."""

    def __init__(self, member: FrozenPolicy, seed: int) -> None:
        self.member = member
        self.generator = torch.Generator(member.model.device).manual_seed(seed)

    @property
    def name(self) -> str:
        return self.member.name

    def act(self, system_prompt: str | None, observation: str) -> str:
        return self.member.act(system_prompt, observation, self.generator)


class ModelOpponent:
    """Another local model in the other seat (``opponent: model``, ``env.opponent_model``):
    one frozen player, its own tokenizer and chat template, for every game. Each game samples
    on a stream of its own (``GameStream``), seeded by (``seed``: ``run.seed``, the game's
    env seed), so what a game plays does not depend on the games beside it; the games of one
    group share their env seed and so their stream, as a scripted opponent's do."""

    def __init__(self, player: FrozenPolicy, seed: int = 0) -> None:
        self.player, self.seed = player, seed
        self.members = [player]

    @classmethod
    def load(cls, name: str, cfg: Any) -> ModelOpponent:
        """``name`` loaded as ``model.name`` would be (same dtype and cache), on the CPU."""
        from turnrl.models import load_model
        from turnrl.rollout.chat import sampling_params

        model, tokenizer = load_model(name, dtype=cfg.model.dtype,
                                      cache_dir=cfg.model.cache_dir or None,
                                      trust_remote_code=cfg.model.trust_remote_code)
        chat = ChatFormat(tokenizer)
        player = FrozenPolicy(model, chat, sampling_params(cfg, chat), 0, cfg.run.seed,
                              label=f"model:{name}")
        return cls(player, cfg.run.seed)

    def sample(self) -> GameStream:
        return GameStream(self.player, self.seed)

    def attach(self, make: Callable[[], Env]) -> Callable[[], Env]:
        """``make`` with each new env's player a ``GameStream``, seeded when the env resets."""
        def make_with_opponent() -> Env:
            env, player = make(), self.sample()
            env.set_opponent(player)
            return seeded_at_reset(env, player.start)
        return make_with_opponent


class GameStream:
    """One game of a frozen player (``opponent: model``): its moves sampled on the game's own
    stream, seeded by ``start(seed)`` from (run seed, the game's env seed)."""

    def __init__(self, member: FrozenPolicy, run_seed: int) -> None:
        self.member, self.run_seed = member, run_seed
        self.generator: torch.Generator | None = None

    @property
    def name(self) -> str:
        return self.member.name

    def start(self, seed: int) -> None:
        """A new game on env seed ``seed``: its stream starts again from that seed."""
        stream_seed = random.Random(f"opponent-model/{self.run_seed}/{seed}").getrandbits(63)
        self.generator = torch.Generator(self.member.model.device).manual_seed(stream_seed)

    def act(self, system_prompt: str | None, observation: str) -> str:
        if self.generator is None:
            raise RuntimeError(f"opponent {self.name}: a move before its game started (the "
                               "env's reset seeds the game's stream)")
        return self.member.act(system_prompt, observation, self.generator)


def seeded_at_reset(env: Env, start: Callable[[int], None]) -> Env:
    """``env`` whose ``reset(seed)`` first calls ``start(seed)`` (on the env's thread, before
    the env's own reset may ask its opponent for a move); the same object, so every other
    attribute the turn loop reads is the env's own."""
    reset = env.reset

    async def reset_and_start(seed: int) -> str:
        start(seed)
        return await reset(seed)
    env.reset = reset_and_start
    return env


def attach_player(make: Callable[[], Env], choose: Callable[[], Any]) -> Callable[[], Env]:
    """``make`` with each new env's opponent ``choose()`` (handed over by ``set_opponent``)."""
    def make_with_opponent() -> Env:
        env = make()
        env.set_opponent(choose())
        return env
    return make_with_opponent
