"""An env's reference player (envs/reference.py) played through the turn loop: the one way a
scripted player's episode is made, for demonstrations (``sft.env_demos``) and for guidance
(``explore.guidance demo``, trainer/guidance.py).

The player never imitates the loop: ``ScriptedEnv`` hands it each observation as the env
returns it, and ``PlayerEngine`` is an engine whose "sample" is its next reply, tokenised as
the policy's would be. ``rollout/loop.py`` then records the episode with its own bookkeeping
(prompt, tokens, loss mask, turns, rewards, end reason), exactly what an RL episode of the same
replies holds.

``--sft.env_demos N`` plays seeds 0..N-1 of ``env.name`` (training seeds; the held-out
evaluation's start at ``eval.seed_offset``) up to ``rollout.max_turns`` turns each; each
successful episode is a demonstration, trained on as the loop recorded it. A self-play game
(``seats``) is played against its first fixed opponent (``eval_opponents``: TicTacToe's
random player, Kuhn Poker's random one), both roles by the seed's parity.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

from turnrl.demos.data import DataError, Demonstration
from turnrl.envs import make_env
from turnrl.envs.contract import fixed_opponent_options, prompt_and_tools
from turnrl.envs.reference import REFERENCE_POLICIES, player_reply, reference_player
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.loop import run_episodes, run_sync
from turnrl.samplers.base import Completion, SamplingParams
from turnrl.types import Episode

UNCUT = SamplingParams(max_new_tokens=sys.maxsize)
"""A demonstration's replies are kept whole, however long (a reply the model's context cannot
hold is refused when tokenised, ``sft.train.check_fits``)."""


def env_demonstrations(env_name: str, options: dict, count: int, chat: ChatFormat,
                       max_turns: int, env_timeout_s: float = 30.0
                       ) -> tuple[list[Demonstration], list[str]]:
    """(demonstrations of the successful episodes, a line per failed one)."""
    if count == 0:
        return [], []
    demos, failed = [], []
    # a self-play game's demonstrations: its reference player against a fixed opponent
    options = fixed_opponent_options(make_env(env_name, **options), options)
    for seed in range(count):
        episode = reference_episode(lambda: make_env(env_name, **options), env_name, seed,
                                    chat, max_turns, env_timeout_s)
        where = f"{env_name} seed {seed}"
        if episode.success:
            demos.append(Demonstration([], None, where, [episode]))
        else:
            failed.append(f"{where}: left out: the scripted player did not succeed in "
                          f"{max_turns} turns")
    return demos, failed


def reference_episode(make: Callable[[], Any], env_name: str, seed: int, chat: ChatFormat,
                      max_turns: int, env_timeout_s: float) -> Episode:
    """The reference player's episode of ``seed`` on an env from ``make``, played through the
    turn loop; ``DataError`` (one line) when the env has no player, or it or its player broke."""
    env = make()
    if not has_reference_player(env, env_name):
        raise DataError(f"sft.env_demos: env '{env_name}' offers no scripted demonstrations "
                        f"(no reference_player(); built-in ones: {', '.join(REFERENCE_POLICIES)})")
    scripted = ScriptedEnv(env, env_name, chat.native_tools)
    (episode,) = run_sync(run_episodes(
        lambda: scripted, [(seed, 0)], PlayerEngine(scripted, chat, 0), chat, UNCUT,
        env_name=env_name, max_turns=max_turns, env_timeout_s=env_timeout_s))
    if episode.status in ("error", "timeout"):
        raise DataError(f"sft.env_demos: env '{env_name}' seed {seed}: "
                        f"{episode.info.get('reason') or episode.end_reason}")
    return episode


async def maybe_await(value: Any) -> Any:
    """An env's reset or step may be ``async`` or plain ``def`` (envs/contract.py)."""
    return await value if inspect.isawaitable(value) else value


def has_reference_player(env: Any, env_name: str) -> bool:
    """Whether ``env`` offers a reference player: its own ``reference_player()`` or a built-in
    one for its name (envs/reference.py)."""
    return callable(getattr(env, "reference_player", None)) or env_name in REFERENCE_POLICIES


class Delegating:
    """An env seen through a wrapper: what the wrapper does not define is the env's own
    (system prompt, tools, ``state_key``, ``cooperative``), so the turn loop sees the env."""

    def __init__(self, env: Any) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_env"], name)

    async def step(self, action: str):
        return await maybe_await(self._env.step(action))


class ScriptedEnv(Delegating):
    """``env`` with its reference player's next reply ready for ``PlayerEngine``: the player
    reads each observation as the env returns it, before the loop asks for the reply. The
    player's failures (it raises, or replies with something not text) are the env's: its
    episode fails with the reason."""

    def __init__(self, env: Any, env_name: str, native_format: str | None = None) -> None:
        super().__init__(env)
        self._env_name, self._native = env_name, native_format
        self.player, self.next_reply = None, ""

    async def reset(self, seed: int) -> str:
        observation = await maybe_await(self._env.reset(seed))
        self.player = player_for(self._env, self._env_name, self._native)
        if self.player is None:
            raise RuntimeError(f"env '{self._env_name}' offers no reference player for seed "
                               f"{seed} (reference_player() returned None)")
        self.player.reset(observation)
        self.next_reply = player_reply(self.player, observation)
        return observation

    async def step(self, action: str):
        result = await super().step(action)
        if not getattr(result, "done", True):  # a malformed result is the loop's to refuse
            self.next_reply = player_reply(self.player, result.observation)
        return result


def player_for(env: Any, env_name: str, native_format: str | None) -> Any:
    """The reference player of a freshly reset ``env``, once the env knows the model's own
    tool-call format: a ``ToolEnv`` learns it from ``tool_prompt``, which the turn loop calls
    only after ``reset``, and its player writes calls in the format the env then holds."""
    prompt_and_tools(env, native_format)
    return reference_player(env, env_name)


class PlayerEngine:
    """An ``Engine`` whose "sample" is the reference player's next reply, tokenised as the
    policy's would be (the reply's tokens and the end of turn), so the turn loop records the
    demonstration with its own bookkeeping. One episode at a time: every prompt gets the
    reply of the one ``ScriptedEnv``. Log-probs are placeholders (0).

    A reply longer than ``max_new_tokens`` is cut there, as the sampler would be, and
    ``longest`` remembers it (guidance refuses such a demonstration: the policy could never
    write it)."""

    def __init__(self, env: ScriptedEnv, chat: ChatFormat, version: int) -> None:
        self.env, self.chat, self.version = env, chat, version
        self.longest = 0
        """The most tokens a reply took, its end of turn included."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams
                 ) -> list[Completion]:
        ids = self.chat.encode(self.env.next_reply) + [self.chat.end_of_turn]
        self.longest = max(self.longest, len(ids))
        finish = "stop"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[:params.max_new_tokens], "length"
        return [Completion(list(ids), [0.0] * len(ids), finish) for _ in prompts]
