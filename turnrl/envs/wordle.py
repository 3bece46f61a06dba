"""Wordle over a small shipped word list, with per-letter feedback in a compact text form.

Feedback follows the standard rules: a letter is G (right spot), Y (in the word elsewhere) or
_ (not in the word, or already accounted for by other copies of that letter).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from functools import cache
from importlib import resources

from turnrl.envs.base import StepResult, register_env


@cache
def load_words() -> dict[int, list[str]]:
    """Word length -> the words of ``data/words.txt`` of that length, in file order."""
    text = resources.files("turnrl.envs").joinpath("data/words.txt").read_text()
    words = [w for line in text.splitlines() if not line.startswith("#") for w in line.split()]
    if len(set(words)) != len(words) or not all(re.fullmatch(r"[a-z]+", w) for w in words):
        raise ValueError("words.txt: words must be distinct lowercase words")
    by_length: dict[int, list[str]] = {}
    for word in words:
        by_length.setdefault(len(word), []).append(word)
    return by_length


def feedback(guess: str, answer: str) -> str:
    """The pattern of ``guess`` against ``answer``, e.g. feedback("geese", "eerie") == "_GY_G"."""
    marks = ["G" if g == a else "_" for g, a in zip(guess, answer, strict=True)]
    # letters of the answer not matched in place; each can turn one other guess letter yellow
    unmatched = Counter(a for a, m in zip(answer, marks, strict=True) if m != "G")
    for i, letter in enumerate(guess):
        if marks[i] != "G" and unmatched[letter] > 0:
            marks[i] = "Y"
            unmatched[letter] -= 1
    return "".join(marks)


def show(guess: str, pattern: str) -> str:
    """Feedback as the agent reads it: "c=G r=Y a=_"."""
    return " ".join(f"{g}={m}" for g, m in zip(guess, pattern, strict=True))


@register_env("wordle")
class Wordle:
    """Multi-turn: guess a hidden word from G/Y/_ letter feedback (LMRL-Gym wordle).

    From LMRL-Gym (Abdulhai et al. 2023, arXiv:2311.18232), on a small list: the hidden word is
    one of the first ``num_words`` words of length ``word_length`` in ``data/words.txt``; any
    listed word of that length may be guessed. A reply with no such word wastes a turn. A
    correct guess pays ``1 - turn_cost * (turns - 1)``. ``info["state_key"]`` is the sorted set
    of (guess, pattern) pairs so far, e.g. "cat=_G_,hat=_GG".
    """

    cooperative = True  # pure Python, never blocks: shares one env thread

    def __init__(self, word_length: int = 4, num_words: int = 40, max_turns: int = 6,
                 turn_cost: float = 0.02):
        words = load_words().get(word_length, [])
        if not 2 <= num_words <= len(words):
            raise ValueError(f"{word_length}-letter words: num_words must be in 2..{len(words)}")
        self.length, self.answers, self.allowed = word_length, words[:num_words], set(words)
        self.max_turns, self.turn_cost = max_turns, turn_cost
        self.system_prompt = (
            f"You are playing wordle with {word_length}-letter words. Reply with one word. After "
            "each guess every letter is marked G (right spot), Y (elsewhere in the word) or _ "
            "(not in the word).")
        self.target, self.turn, self.history = "", 0, set()

    @property
    def state_key(self) -> str:
        return ",".join(sorted(f"{g}={p}" for g, p in self.history)) or "none"

    async def reset(self, seed: int) -> str:
        self.target = random.Random(seed).choice(self.answers)
        self.turn, self.history = 0, set()
        return (f"Guess my {self.length}-letter word (one of {len(self.answers)}) "
                f"in {self.max_turns} tries.")

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        words = re.findall(r"[a-z]+", action.lower())
        guess = next((w for w in words if w in self.allowed and len(w) == self.length), None)
        if guess is None:
            sized = any(len(w) == self.length for w in words)
            reply = "Not in my word list." if sized else f"Use a {self.length}-letter word."
        else:
            pattern = feedback(guess, self.target)
            self.history.add((guess, pattern))
            if guess == self.target:
                reward = max(0.0, 1.0 - self.turn_cost * (self.turn - 1))
                info = {"success": True, "turns": self.turn, "state_key": self.state_key}
                return StepResult("Correct!", reward, True, info)
            reply = show(guess, pattern)
        info = {"success": False, "turns": self.turn, "state_key": self.state_key}
        return StepResult(reply, 0.0, self.turn >= self.max_turns, info)
