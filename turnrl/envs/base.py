"""The environment protocol and the registry of built-in environments.

An environment implements ``reset`` and ``step`` and nothing else: the framework owns the
turn loop, the chat template and the token bookkeeping (the verifiers ``MultiTurnEnv`` and
open-instruct environment designs keep the same split). Both methods are ``async`` so a slow
tool never blocks the other episodes of a step.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable


class StepResult(NamedTuple):
    observation: str
    """What the environment says back (the next user message); ignored when ``done``."""
    reward: float
    done: bool
    info: dict[str, Any] = {}
    """Free-form facts; ``info["success"]`` (bool) marks a solved episode for evaluation."""


@runtime_checkable
class Env(Protocol):
    """``reset`` and ``step``; an optional ``system_prompt`` attribute sets the system message.

    Both must really be asynchronous: the per-step timeout can only interrupt code that
    awaits. Run blocking work (a subprocess, a slow library call) with
    ``await asyncio.to_thread(...)`` or ``asyncio.create_subprocess_exec``.

    Each env runs on a thread of its own, so one that blocks anyway blocks only itself. A
    class attribute ``cooperative = True`` promises that it never blocks: such envs share one
    thread (cheaper; one that blocks anyway stalls the others until their timeouts, and then
    loses the share: ``turnrl.rollout.env_calls.SharedLoop``).
    """

    async def reset(self, seed: int) -> str:
        """Start a new episode, deterministic under ``seed``; return the first observation."""
        ...

    async def step(self, action: str) -> StepResult:
        """Apply the policy's reply (plain text) and return what happened."""
        ...


ENVS: dict[str, Callable[..., Env]] = {}
"""Environment name -> factory taking the ``env.options`` keyword arguments."""


def register_env(name: str) -> Callable[[Callable[..., Env]], Callable[..., Env]]:
    """Class decorator: make an environment available as ``env.name``."""

    def add(factory: Callable[..., Env]) -> Callable[..., Env]:
        ENVS[name] = factory
        return factory

    return add


def make_env(name: str, **options: Any) -> Env:
    """Build a registered environment, with one-line errors for bad names or options."""
    if name not in ENVS:
        close = difflib.get_close_matches(name, ENVS, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"choose one of: {', '.join(ENVS)}"
        raise ValueError(f"unknown environment '{name}'; {hint}")
    try:
        return ENVS[name](**options)
    except (TypeError, AssertionError) as err:  # a wrong keyword; a generator's own check
        raise ValueError(f"bad env.options for '{name}': {err}") from None
