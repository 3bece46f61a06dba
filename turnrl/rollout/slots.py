"""The turn loop's records of what is in play (rollout/loop.py): the groups waiting to start
(``Feed``), one live episode (``Slot``), one multi-seat game (``Game``, rollout/seats.py), one
group's progress (``GroupState``) and a finished group as the loop hands it out (``Group``)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from turnrl.envs.base import Env
from turnrl.rollout.env_calls import EnvRunner
from turnrl.types import ENV_VERSION, Episode

# Where a live episode stands (_WAIT: a seat of a game waiting for the other seats' moves;
# BRANCH: a fork's new env replaying its trunk, rollout/branch.py).
RESET, POLICY, ENV, WAIT, BRANCH = "reset", "policy", "env", "wait", "branch"


class Feed:
    """Groups waiting to start, oldest first: (assignment, seed, group label, episodes, play:
    the group's own (env factory, temperature), either None for the loop's). The
    assignments are kept in a set too: a scan of the feed on each submit made a long feed (an
    evaluation's episodes, submitted at once) quadratic. The loop's lock guards it."""

    def __init__(self) -> None:
        self._items: deque[tuple[int, int, int, int, tuple]] = deque()
        self._queued: set[int] = set()

    def __contains__(self, assignment: int) -> bool:
        return assignment in self._queued

    def __bool__(self) -> bool:
        return bool(self._items)

    def push(self, assignment: int, seed: int, group: int, episodes: int,
             play: tuple = (None, None)) -> None:
        self._items.append((assignment, seed, group, episodes, play))
        self._queued.add(assignment)

    def pop(self) -> tuple[int, int, int, int, tuple]:
        """The oldest group waiting."""
        item = self._items.popleft()
        self._queued.discard(item[0])
        return item

    def drop(self, assignments: Iterable[int]) -> set[int]:
        """Take ``assignments`` out where they are waiting; returns those that were."""
        dropped = self._queued.intersection(assignments)
        if dropped:
            self._items = deque(item for item in self._items if item[0] not in dropped)
            self._queued -= dropped
        return dropped

    def assignments(self) -> set[int]:
        return set(self._queued)


@dataclass
class Slot:
    episode: Episode
    assignment: int
    env: Env
    runner: EnvRunner
    phase: str = RESET
    task: asyncio.Future | None = None
    """The env.reset or env.step in flight."""
    turn: tuple | None = None
    """(completion, text, start, end) of the action whose env step is in flight."""
    messages: list[dict] = field(default_factory=list)
    rendered: str = ""
    """The conversation so far, as the chat template renders it (the policy's reply aside)."""
    tools: list[dict] | None = None
    """Tool schemas the template renders (an env with tools, a template that has them)."""
    state: str = ""
    """Key of the state the next action is taken in (see ``Turn.state``)."""
    game: Game | None = None
    """The multi-seat game this slot is one seat of (None: a single-agent episode)."""
    seat: str = ""
    pending_reward: float = 0.0
    """Reward the env gave this seat's open turn (a mid-game step's reward)."""
    temperature: float | None = None
    """Its group's sampling temperature (None: the loop's ``params``)."""
    first: str = ""
    """The env's first observation (a fork's replay checks its own against it)."""
    make: Any = None
    """The factory its env came from (a fork builds its siblings' envs with it)."""


@dataclass
class Game:
    """One play of a multi-seat env: its seats' slots share ``env`` and its thread."""

    env: Env
    seats: dict[str, Slot] = field(default_factory=dict)
    number: int = 0
    """The game's number in its turn loop: each seat's episode records it as ``game_id``."""
    order: list[str] = field(default_factory=list)
    """The seat of each move so far, in play order: each seat's episode records it as
    ``play_order`` when the game ends (its k-th entry for seat S is S's k-th turn)."""


@dataclass
class GroupState:
    seed: int
    episodes: list[Episode]
    open: int
    started_at: float


@dataclass
class Group:
    """The ``group_size`` episodes of one assignment (one seed), all ended."""

    assignment: int
    """Id the learner gave this piece of work; a redelivered id is a duplicate."""
    seed: int
    episodes: list[Episode]
    worker: int = -1
    """Index of the rollout worker that played it (-1 outside Ray)."""
    started_at: float = 0.0
    finished_at: float = 0.0

    def policy_versions(self) -> list[int]:
        """Version of every policy token of every episode (environment tokens left out)."""
        return [v for ep in self.episodes for v in ep.versions if v != ENV_VERSION]

    @property
    def oldest_version(self) -> int | None:
        """Version of the group's oldest policy token; None if no episode generated any."""
        versions = self.policy_versions()
        return min(versions) if versions else None
