"""Several environments in one run (``env.mix``): each group's env is drawn by weight.

The draw is a pure function of the run's seed and the group's env seed (``mix_choice``), and a
step's groups have their seeds from ``run.seed`` and the step (``turnrl.policy.training_seeds``):
so the draw is deterministic, a resumed run draws what the uninterrupted one did, and every
episode of a group plays the same env. ``MixEnv`` makes that choice when the turn loop starts
the game (``choose_for_seed``; at ``reset`` when nothing did) and hands every later call to the
chosen env, so a mix plays in one batched turn loop like any single env, a self-play entry's
seats included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from turnrl.envs.base import Env, StepResult
from turnrl.envs.reference import reference_player


def mix_choice(weights: Sequence[float], run_seed: int, seed: int) -> int:
    """Index of the env a group with env seed ``seed`` plays: entry i with probability
    ``weights[i] / sum(weights)``, the same for the same (run seed, seed)."""
    draw = np.random.default_rng([run_seed, seed, 0x6D6978]).random()  # 0x6D6978: "mix"
    cumulative = np.cumsum(weights) / float(np.sum(weights))
    return min(int(np.searchsorted(cumulative, draw, side="right")), len(weights) - 1)


class MixEnv:
    """Plays, per ``reset(seed)``, the env ``mix_choice`` draws; every other call goes to it.
    ``names``: each entry's registered env name, for its built-in reference player.

    The turn loop draws before the reset (``choose_for_seed``, envs/contract.py), so a drawn
    self-play game's ``seats`` are read as its own: one slot per seat, as when it runs alone.
    ``takes_opponent[i]``: entry i plays an outside opponent, the player the trainer hands
    over (``set_opponent``, before the draw) when that entry is drawn."""

    def __init__(self, makers: Sequence[Callable[[], Env]], weights: Sequence[float],
                 run_seed: int, names: Sequence[str] = (),
                 takes_opponent: Sequence[bool] = ()) -> None:
        self.makers, self.weights, self.run_seed = list(makers), list(weights), run_seed
        self.names = list(names) or [""] * len(self.makers)
        self.takes_opponent = list(takes_opponent) or [False] * len(self.makers)
        self.player: Any = None
        self.current: Env | None = None
        self.drawn = 0
        self.chosen: int | None = None
        """The seed of a draw not reset yet (``choose_for_seed``)."""
        self.failed: Exception | None = None

    def choose_for_seed(self, seed: int) -> None:
        """Draw and build the env ``seed`` plays. A build that fails is kept and raised by
        the reset, so it fails that game only, as a failing reset does."""
        self.drawn = mix_choice(self.weights, self.run_seed, seed)
        self.chosen, self.failed = seed, None
        try:
            self.current = self.makers[self.drawn]()
            if self.takes_opponent[self.drawn] and self.player is not None:
                self.current.set_opponent(self.player)
        except Exception as err:  # noqa: BLE001 - env code: the game's reset reports it
            self.current, self.failed = None, err

    def set_opponent(self, player: Any) -> None:
        """The outside player of this game, for an entry that takes one (``takes_opponent``)."""
        self.player = player

    async def reset(self, seed: int) -> str:
        if self.chosen != seed:  # not drawn for this seed yet (not the turn loop, a second game)
            self.choose_for_seed(seed)
        self.chosen = None
        if self.failed is not None:
            raise self.failed
        return await self.current.reset(seed)

    def reference_player(self):
        """The drawn env's reference player: its own, else the built-in one for its name
        (envs/reference.py); None when it has neither or nothing is drawn yet."""
        if self.current is None:
            return None
        return reference_player(self.current, self.names[self.drawn])

    async def step(self, action: str) -> StepResult:
        if self.current is None:
            raise RuntimeError("MixEnv.step before reset: no env has been drawn yet")
        return await self.current.step(action)

    def __getattr__(self, name: str) -> Any:
        """The drawn env's attributes (system_prompt, seats, tools, ...); none before the draw."""
        current = self.__dict__.get("current")
        if current is None:
            raise AttributeError(name)
        return getattr(current, name)
