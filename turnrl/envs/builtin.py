"""Built-in tasks with verifiable rewards, deterministic under a seed."""

from __future__ import annotations

import random

from turnrl.envs.base import StepResult, register_env
from turnrl.rewards import first_integer, integer_match


@register_env("arithmetic")
class Arithmetic:
    """Single turn: add two integers; reward 1 when the reply's number is the sum."""

    cooperative = True  # pure Python, never blocks: shares one env thread

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
    ``info["state_key"]`` is the interval the replies so far leave feasible, e.g. "6..10".
    """

    cooperative = True  # pure Python, never blocks: shares one env thread

    system_prompt = "You are playing a number guessing game. Always reply with one number only."

    def __init__(self, low: int = 1, high: int = 10, max_turns: int = 5, turn_cost: float = 0.1):
        self.low, self.high, self.max_turns, self.turn_cost = low, high, max_turns, turn_cost
        self.target, self.turn = 0, 0
        self.lo, self.hi = low, high  # what the replies so far leave possible

    @property
    def state_key(self) -> str:
        return f"{self.lo}..{self.hi}"

    async def reset(self, seed: int) -> str:
        self.target = random.Random(seed).randint(self.low, self.high)
        self.turn = 0
        self.lo, self.hi = self.low, self.high
        return (f"I am thinking of a number between {self.low} and {self.high}. You have "
                f"{self.max_turns} guesses; after each one I say higher or lower. Your guess?")

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        guess = first_integer(action)
        if guess == self.target:
            self.lo = self.hi = guess
            reward = max(0.0, 1.0 - self.turn_cost * (self.turn - 1))  # >= 0 for long games
            info = {"success": True, "turns": self.turn, "state_key": self.state_key}
            return StepResult("Correct!", reward, True, info)
        if guess is None:
            reply = f"Reply with one number between {self.low} and {self.high}."
        elif guess < self.target:
            reply, self.lo = "Higher.", max(self.lo, guess + 1)
        else:
            reply, self.hi = "Lower.", min(self.hi, guess - 1)
        info = {"success": False, "turns": self.turn, "state_key": self.state_key}
        return StepResult(reply, 0.0, self.turn >= self.max_turns, info)
