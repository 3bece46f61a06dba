"""Built-in tasks with verifiable rewards, deterministic under a seed."""

from __future__ import annotations

import random

from turnrl.envs.base import StepResult, register_env
from turnrl.rewards import first_integer, integer_match


@register_env("arithmetic")
class Arithmetic:
    """Single turn: add two integers; reward 1 when the reply's number is the sum."""

    def __init__(self, low: int = 1, high: int = 50, parse: str = "last"):
        self.low, self.high, self.parse = low, high, parse
        self.answer = 0

    async def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        self.answer = a + b
        return f"Compute {a}+{b}. Reply with just the number."

    async def step(self, action: str) -> StepResult:
        reward = integer_match(action, self.answer, which=self.parse)
        return StepResult("", reward, True, {"success": reward == 1.0})


@register_env("guess-number")
class GuessNumber:
    """Multi-turn: find a hidden integer in [low, high], told "higher" or "lower" each turn.

    Success pays ``1 - turn_cost * (turns used - 1)``; a reply without a number wastes a turn.
    A player that halves the range needs ceil(log2(high - low + 1)) turns at most.
    """

    system_prompt = "You are playing a number guessing game. Always reply with one number only."

    def __init__(self, low: int = 1, high: int = 10, max_turns: int = 5, turn_cost: float = 0.1):
        self.low, self.high, self.max_turns, self.turn_cost = low, high, max_turns, turn_cost
        self.target, self.turn = 0, 0

    async def reset(self, seed: int) -> str:
        self.target = random.Random(seed).randint(self.low, self.high)
        self.turn = 0
        return (f"I am thinking of a number between {self.low} and {self.high}. You have "
                f"{self.max_turns} guesses; after each one I say higher or lower. Your guess?")

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        guess = first_integer(action)
        if guess == self.target:
            reward = 1.0 - self.turn_cost * (self.turn - 1)
            return StepResult("Correct!", reward, True, {"success": True, "turns": self.turn})
        if guess is None:
            reply = f"Reply with one number between {self.low} and {self.high}."
        else:
            reply = "Higher." if guess < self.target else "Lower."
        info = {"success": False, "turns": self.turn}
        return StepResult(reply, 0.0, self.turn >= self.max_turns, info)
