"""Twenty questions with a scripted oracle over a small shipped table of objects.

The agent asks about one attribute a turn ("animal?") or guesses an object ("guess: cat");
only the final answer pays, so the value of each question shows only through the outcome.
"""

from __future__ import annotations

import json
import random
import re
from functools import cache
from importlib import resources
from typing import NamedTuple

from turnrl.envs.base import StepResult, register_env


class ObjectTable(NamedTuple):
    attributes: dict[str, str]
    """Attribute name -> what a yes means, in table order."""
    aliases: dict[str, str]
    """Other words for an attribute ("fly" -> "flies")."""
    objects: dict[str, frozenset[str]]
    """Object name -> its true attributes, in table order (``num_objects`` takes a prefix)."""


@cache
def load_objects() -> ObjectTable:
    """The shipped table ``data/objects.json``, checked so every object can be told apart."""
    raw = json.loads(resources.files("turnrl.envs").joinpath("data/objects.json").read_text())
    table = ObjectTable(raw["attributes"], raw["aliases"],
                        {name: frozenset(attrs) for name, attrs in raw["objects"].items()})
    words = [*table.attributes, *table.aliases, *table.objects]
    if len(set(words)) != len(words) or not all(re.fullmatch(r"[a-z]+", w) for w in words):
        raise ValueError("objects.json: names must be distinct lowercase words")
    if not all(a in table.attributes for a in table.aliases.values()) or not all(
            attrs <= table.attributes.keys() for attrs in table.objects.values()):
        raise ValueError("objects.json: unknown attribute")
    if len(set(table.objects.values())) != len(table.objects):
        raise ValueError("objects.json: two objects have the same attributes")
    return table


def _lookup(word: str, names: dict | set) -> str | None:
    """``word`` or its singular ("animals" -> "animal") when it is one of ``names``."""
    for form in (word, word[:-1] if word.endswith("s") else None):
        if form in names:
            return form
    return None


@register_env("twenty-questions")
class TwentyQuestions:
    """Multi-turn: find a hidden object by yes/no attribute questions (LMRL-Gym twenty questions).

    From LMRL-Gym (Abdulhai et al. 2023, arXiv:2311.18232), with a scripted oracle over
    ``data/objects.json`` instead of an LLM oracle. The hidden object is one of the first
    ``num_objects`` objects of the table, listed in the first observation. A correct guess pays
    ``1 - turn_cost * (turns - 1)``; anything else pays 0. A reply that names no attribute and
    no listed object wastes a turn. ``info["state_key"]`` is the sorted set of facts learnt,
    e.g. "animal=y,cat=n,flies=n" (wrong guesses count as facts).
    """

    cooperative = True  # pure Python, never blocks: shares one env thread

    def __init__(self, num_objects: int = 16, max_turns: int = 10, turn_cost: float = 0.02):
        table = load_objects()
        if not 2 <= num_objects <= len(table.objects):
            raise ValueError(f"num_objects must be in 2..{len(table.objects)}")
        self.candidates = list(table.objects)[:num_objects]
        self.candidate_set = set(self.candidates)
        self.max_turns, self.turn_cost = max_turns, turn_cost
        self.table = table
        self.system_prompt = (
            "You are playing twenty questions. Each turn either ask about one property, "
            f"one of: {', '.join(table.attributes)} (e.g. 'animal?'), or guess (e.g. "
            "'guess: cat'). Reply with one or two words.")
        self.target, self.turn, self.facts = "", 0, {}

    @property
    def state_key(self) -> str:
        return ",".join(sorted(f"{k}={'y' if v else 'n'}" for k, v in self.facts.items())) or "none"

    async def reset(self, seed: int) -> str:
        self.target = random.Random(seed).choice(self.candidates)
        self.turn, self.facts = 0, {}
        return (f"I am thinking of one of: {', '.join(self.candidates)}. "
                f"Find it in {self.max_turns} turns.")

    def _parse(self, action: str) -> tuple[str, str | None]:
        """("guess", object), ("ask", attribute) or ("invalid", None)."""
        words = re.findall(r"[a-z]+", action.lower())
        objects = {o for w in words if (o := _lookup(w, self.candidate_set))}
        if len(objects) == 1:
            return "guess", objects.pop()
        attrs = {a for w in words
                 if (a := _lookup(self.table.aliases.get(w, w), self.table.attributes))}
        if len(attrs) == 1 and not objects and words[0] != "guess":
            return "ask", attrs.pop()
        return "invalid", None  # nothing, several things, or a guess of an unlisted object

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        kind, name = self._parse(action)
        if kind == "guess" and name == self.target:
            self.facts[name] = True
            reward = max(0.0, 1.0 - self.turn_cost * (self.turn - 1))
            return StepResult("Yes, you got it!", reward, True,
                              {"success": True, "turns": self.turn, "state_key": self.state_key})
        if kind == "guess":
            self.facts[name] = False
            reply = f"No, not {name}."
        elif kind == "ask":
            self.facts[name] = name in self.table.objects[self.target]
            reply = "Yes." if self.facts[name] else "No."
        else:
            reply = (f"I don't understand. Ask about one of: {', '.join(self.table.attributes)}; "
                     "or guess a listed object.")
        info = {"success": False, "turns": self.turn, "state_key": self.state_key}
        return StepResult(reply, 0.0, self.turn >= self.max_turns, info)
