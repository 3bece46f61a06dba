"""Scripted near-optimal players for the multi-turn tasks, reading only what the agent reads.

They prove each task solvable in tests and can write warm-up demonstrations for a small
model. A policy sees the first observation in ``reset`` and every observation (the first
one too) in ``act``; besides that text it knows only the game's public facts (the object
table and the word list that the agent is expected to know), never the hidden answer.
"""

from __future__ import annotations

import re
from typing import Protocol

from turnrl.envs.base import Env
from turnrl.envs.maze import MOVES, step_from
from turnrl.envs.twenty_questions import load_objects
from turnrl.envs.wordle import feedback, load_words


class Policy(Protocol):
    def reset(self, first_observation: str) -> None: ...

    def act(self, observation: str) -> str: ...


class GuessNumberPolicy:
    """Bisection on the interval still possible."""

    def reset(self, first_observation: str) -> None:
        low, high = re.search(r"between (-?\d+) and (-?\d+)", first_observation).groups()
        self.lo, self.hi, self.last = int(low), int(high), None

    def act(self, observation: str) -> str:
        if self.last is not None and observation.startswith("Higher"):
            self.lo = self.last + 1
        elif self.last is not None and observation.startswith("Lower"):
            self.hi = self.last - 1
        self.last = (self.lo + self.hi) // 2
        return str(self.last)


class TwentyQuestionsPolicy:
    """Ask the attribute that splits the remaining objects most evenly; guess at two or fewer."""

    def reset(self, first_observation: str) -> None:
        self.table = load_objects()
        listed = re.search(r"one of: ([a-z, ]+)\.", first_observation).group(1)
        self.remaining = listed.split(", ")
        self.last: tuple[str, str] | None = None

    def act(self, observation: str) -> str:
        if self.last is not None:
            kind, name = self.last
            if kind == "guess":
                self.remaining.remove(name)
            elif observation.startswith(("Yes", "No")):
                yes = observation.startswith("Yes")
                self.remaining = [o for o in self.remaining
                                  if (name in self.table.objects[o]) == yes]
        if len(self.remaining) <= 2:
            self.last = ("guess", self.remaining[0])
            return f"guess: {self.remaining[0]}"
        attr = min(self.table.attributes, key=lambda a: abs(
            2 * sum(a in self.table.objects[o] for o in self.remaining) - len(self.remaining)))
        self.last = ("ask", attr)
        return f"{attr}?"


class MazePolicy:
    """Depth-first exploration by dead reckoning; step onto the goal as soon as it shows."""

    def reset(self, first_observation: str) -> None:
        self.pos, self.visited, self.path = (0, 0), {(0, 0)}, []
        self.last: tuple[str, bool] | None = None  # (direction, is a step back)

    def act(self, observation: str) -> str:
        if self.last is not None and not observation.startswith(("Wall", "Say")):
            direction, back = self.last
            self.pos = step_from(self.pos, direction)
            self.visited.add(self.pos)
            if back:
                self.path.pop()
            else:
                self.path.append(direction)
        opened = re.search(r"open: ([a-z, ]*)", observation).group(1).split(", ")
        goal = re.search(r"goal: ([a-z]+)", observation)
        fresh = [d for d in opened if d in MOVES and step_from(self.pos, d) not in self.visited]
        if goal or fresh:
            self.last = (goal.group(1) if goal else fresh[0], False)
        else:  # dead end: retrace the last forward step
            dr, dc = MOVES[self.path[-1]]
            self.last = (next(d for d, v in MOVES.items() if v == (-dr, -dc)), True)
        return self.last[0]


class WordlePolicy:
    """Guess the first listed word still consistent with every pattern seen."""

    def reset(self, first_observation: str) -> None:
        length, count = re.search(r"(\d+)-letter word \(one of (\d+)\)", first_observation).groups()
        self.candidates = load_words()[int(length)][:int(count)]
        self.last: str | None = None

    def act(self, observation: str) -> str:
        marks = re.findall(r"[a-z]=([GY_])", observation)
        if self.last is not None and marks:
            pattern = "".join(marks)
            self.candidates = [w for w in self.candidates if feedback(self.last, w) == pattern]
        self.last = self.candidates[0]
        return self.last


class ScriptedReplies:
    """Replies fixed in advance, one per turn (an oracle's: built by an env that knows its
    answer); past the last it repeats the last."""

    def __init__(self, replies: list[str]):
        if not replies:
            raise ValueError("ScriptedReplies needs at least one reply")
        self.replies, self.turn = list(replies), 0

    def reset(self, first_observation: str) -> None:
        self.turn = 0

    def act(self, observation: str) -> str:
        reply = self.replies[min(self.turn, len(self.replies) - 1)]
        self.turn += 1
        return reply


class Replanner:
    """Asks ``next_reply()`` afresh each turn: a planner reading the env's current state."""

    def __init__(self, next_reply):
        self.next_reply = next_reply

    def reset(self, first_observation: str) -> None:
        pass

    def act(self, observation: str) -> str:
        return self.next_reply()


REFERENCE_POLICIES: dict[str, type] = {
    "guess-number": GuessNumberPolicy,
    "twenty-questions": TwentyQuestionsPolicy,
    "maze": MazePolicy,
    "wordle": WordlePolicy,
}
"""Environment name -> scripted policy class (built without arguments)."""


def reference_player(env: Env, env_name: str) -> Policy | None:
    """The scripted player for ``env``: its own ``reference_player()`` when it has one (an
    adapter's oracle may read the env's hidden answer), else the built-in one for
    ``env_name``, else None. Call it after ``env.reset``; the player's ``reset`` comes next."""
    own = getattr(env, "reference_player", None)
    if callable(own):
        return own()
    cls = REFERENCE_POLICIES.get(env_name)
    return cls() if cls is not None else None


class NotTextReply(TypeError):
    """A reference player replied with something that is not text."""


def player_reply(player: Policy, observation: str) -> str:
    """``player.act(observation)``, refused in one line unless it is text (a player returning
    None or a number would otherwise fail deep in the tokenizer, far from its cause)."""
    reply = player.act(observation)
    if not isinstance(reply, str):
        raise NotTextReply(f"the reference player's act() returned {type(reply).__name__}, not "
                        "text; return the reply as a str")
    return reply


async def play(env: Env, policy: Policy, seed: int,
               transcript: list[tuple[str, str]] | None = None) -> tuple[float, bool, int]:
    """One episode; returns (total reward, success, turns) and appends each
    (observation, action) pair to ``transcript`` when one is given."""
    observation = await env.reset(seed)
    policy.reset(observation)
    total, turns = 0.0, 0
    while True:
        action = player_reply(policy, observation)
        if transcript is not None:
            transcript.append((observation, action))
        result = await env.step(action)
        total, turns = total + result.reward, turns + 1
        if result.done:
            return total, bool(result.info.get("success")), turns
        observation = result.observation
