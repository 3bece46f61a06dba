"""Wrappers that change how an environment talks, not what it asks.

``try-again`` turns a single-turn task into a multi-turn one with unary feedback: after a
wrong answer the next observation is only "Let's try again." (UFO: Liu et al. 2025, "A Simple
'Try Again' Can Elicit Multi-Turn LLM Reasoning", arXiv:2507.14295). A correct answer on
attempt ``k`` (1-based) pays ``discount ** (k - 1)`` times the inner reward, so fewer attempts
are worth more; this exponential per-attempt decay follows the paper's idea of rewarding
fewer turns (its exact constant was not re-checked here: ``discount`` is an option).
"""

from __future__ import annotations

from typing import Any

from turnrl.envs.base import StepResult, make_env, register_env
from turnrl.envs.contract import eval_options


def attempt_reward(inner_reward: float, attempt: int, discount: float) -> float:
    """Reward of a success on 1-based ``attempt``: ``inner_reward * discount ** (attempt - 1)``."""
    return inner_reward * discount ** (attempt - 1)


@register_env("try-again")
class TryAgain:
    """Multi-turn from any single-turn env: "Let's try again." after a wrong answer (UFO)."""

    def __init__(self, inner: str = "arithmetic", max_attempts: int = 3, discount: float = 0.9,
                 feedback: str = "Let's try again.", **inner_options: Any):
        if max_attempts < 1:
            raise ValueError(f"try-again needs max_attempts >= 1, got {max_attempts}")
        self.env = make_env(inner, **inner_options)
        self.cooperative = getattr(self.env, "cooperative", False)  # as its inner env
        self.eval_options = eval_options(self.env)  # its options pass to the inner env
        self.max_attempts, self.discount, self.feedback = max_attempts, discount, feedback
        self.seed, self.attempt = 0, 0
        if hasattr(self.env, "system_prompt"):
            self.system_prompt = self.env.system_prompt

    async def reset(self, seed: int) -> str:
        self.seed, self.attempt = seed, 0
        self.question = await self.env.reset(seed)
        return self.question

    async def step(self, action: str) -> StepResult:
        self.attempt += 1
        result = await self.env.step(action)
        info = dict(result.info or {})
        solved = bool(info.get("success", result.reward >= 1.0))
        info.update(success=solved, attempts=self.attempt)
        if solved:
            return StepResult("", attempt_reward(result.reward, self.attempt, self.discount),
                              True, info)
        # the inner env is done after one answer: re-open the same question for the next one
        await self.env.reset(self.seed)
        return StepResult(self.feedback, 0.0, self.attempt >= self.max_attempts, info)
