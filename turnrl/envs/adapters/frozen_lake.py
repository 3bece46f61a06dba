"""FrozenLake's options beyond gymnasium's fixed maps, and the protocol RAGEN reports on.

``gymnasium`` with ``game FrozenLake-v1`` (gymnasium_env.py) plays gymnasium's own
``FrozenLakeEnv``: its dynamics are gymnasium's, so ``is_slippery true`` moves the intended
way with probability 1/3 and to each side of it (perpendicular) with 1/3. This module adds:

- ``size N``: a new N x N map for every episode seed (``random_lake``): each cell frozen with
  probability ``frozen`` (0.8, as gymnasium's ``generate_random_map(p=0.8)``), drawn again
  until a path of non-hole cells joins start and goal (breadth-first, ``has_path``). ``ends``:
  ``corners`` (gymnasium's placement: start top-left, goal bottom-right) or ``random`` (two
  distinct random cells, RAGEN's placement). Written here from the idea, seeded with
  ``random.Random(seed)``: the maps are not gymnasium's or RAGEN's draws for the same seed.
- ``actions_per_turn K`` and ``max_actions M``: a reply may chain up to K moves separated by
  ``||`` (the text inside the last ``<answer>...</answer>``, when there is one), played in
  order until the episode ends; the episode also ends after M moves in all (0: no cap).
- ``render ragen``: RAGEN's grid text (``P`` you, ``_`` frozen, ``O`` hole, ``G`` goal, ``X``
  you in a hole, ``√`` you on the goal) instead of gymnasium's ANSI made plain.

``protocol ragen`` sets them as RAGEN runs FrozenLake (Wang et al. 2025, "RAGEN:
Understanding Self-Evolution in LLM Agents via Multi-Turn Reinforcement Learning",
arXiv:2504.20073), read in github.com/RAGEN-AI/RAGEN at commit 5eb79b8 (2025-09-06):

- ``ragen/env/frozen_lake/config.py``: ``size 4``, ``p 0.8`` (frozen), ``is_slippery True``,
  ``map_seed`` = the episode seed (a new map per seed);
- ``ragen/env/frozen_lake/utils.py``: start and goal at random distinct cells, redrawn until
  a path exists;
- ``config/envs.yaml`` (``FrozenLake``): ``max_actions_per_traj 10``, ``max_tokens 100``;
- ``config/base.yaml``: ``agent_proxy.max_turn 5``, ``max_actions_per_turn 5``,
  ``action_sep "||"``; ``es_manager.format_penalty -0.1``; validation 256 episodes (one
  per seed), ``val_kwargs.temperature 0.5``; training groups of 16, temperature 1.

The preset sets the env's part (map, slipperiness, turns, moves); the run's part is the
run's options: ``--eval.episodes 256 --eval.temperature 0.5 --rollout.max_new_tokens 100``
(``benchmarks/learning/ragen_frozenlake.py`` passes them). Options given beside the preset
win over it. Departures: no format penalty (a reply naming no move wastes its turn and earns
nothing; success is the signal); replies are read leniently (any legal action name, any
case), where RAGEN requires its ``<think>/<answer>`` format; the instruction is written here.
"""

from __future__ import annotations

import random
import re
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Literal

RAGEN = {"size": 4, "frozen": 0.8, "ends": "random", "is_slippery": True, "max_turns": 5,
         "actions_per_turn": 5, "max_actions": 10, "render": "ragen"}
"""``protocol ragen``: RAGEN's FrozenLake (see the module docstring for where each is set)."""
PROTOCOLS = {"ragen": RAGEN}
RAGEN_CELLS = {"F": "_", "S": "_", "H": "O", "G": "G"}
RAGEN_NAMES = ["Left", "Down", "Right", "Up"]


@dataclass(frozen=True)
class LakeSettings:
    """How a FrozenLake episode is drawn, told and played (the defaults: gymnasium's)."""

    size: int = 0
    """0: gymnasium's map (``map_name``, ``desc``); N: a new N x N map per episode seed"""
    frozen: float = 0.8
    ends: Literal["corners", "random"] = "corners"
    actions_per_turn: int = 1
    max_actions: int = 0
    render: Literal["gymnasium", "ragen"] = "gymnasium"
    max_turns: int = 30

    def check(self, make_options: dict[str, Any]) -> LakeSettings:
        if self.size and ({"desc", "map_name"} & make_options.keys()):
            raise ValueError("FrozenLake: 'size' draws a map per seed; drop 'desc'/'map_name'")
        if self.size == 1 or not 0 < self.frozen <= 1 or self.ends not in ("corners", "random"):
            raise ValueError("FrozenLake: size >= 2, 0 < frozen <= 1, ends corners|random")
        if self.actions_per_turn < 1 or self.max_actions < 0 or self.max_turns < 1 \
                or self.render not in ("gymnasium", "ragen"):
            raise ValueError("FrozenLake: actions_per_turn >= 1, max_actions >= 0, "
                             "max_turns >= 1, render gymnasium|ragen")
        return self

    @property
    def plain(self) -> bool:
        """One move a turn on gymnasium's text: the adapter as it was before these options."""
        return self.actions_per_turn == 1 and not self.max_actions and self.render == "gymnasium"


def lake_settings(protocol: str, max_turns: int | None, options: dict[str, Any]
                  ) -> tuple[LakeSettings, dict[str, Any]]:
    """(the episode settings, what goes on to ``gym.make``) from ``env.options``: the
    protocol's values first, the options given over them."""
    if protocol and protocol not in PROTOCOLS:
        raise ValueError(f"unknown FrozenLake protocol '{protocol}'; choose: {', '.join(PROTOCOLS)}")
    merged = {**PROTOCOLS.get(protocol, {}), **options}
    if max_turns is not None:
        merged["max_turns"] = max_turns
    fields = LakeSettings.__dataclass_fields__
    mine = {k: v for k, v in merged.items() if k in fields}
    make_options = {k: v for k, v in merged.items() if k not in fields}
    return replace(LakeSettings(), **mine).check(make_options), make_options


def has_path(rows: list[str]) -> bool:
    """Whether non-hole cells join ``S`` to ``G`` by moves up, down, left and right."""
    n, m = len(rows), len(rows[0])
    start = next((r, c) for r in range(n) for c in range(m) if rows[r][c] == "S")
    seen, frontier = {start}, deque([start])
    while frontier:
        r, c = frontier.popleft()
        if rows[r][c] == "G":
            return True
        for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= nr < n and 0 <= nc < m and rows[nr][nc] != "H" and (nr, nc) not in seen:
                seen.add((nr, nc))
                frontier.append((nr, nc))
    return False


def random_lake(size: int, frozen: float, seed: int, ends: str = "corners") -> list[str]:
    """A ``size`` x ``size`` map drawn from ``seed``: each cell frozen with probability
    ``frozen``, else a hole; start and goal at the corners or at two random cells; drawn
    again until ``has_path``."""
    rng = random.Random(seed)
    while True:
        grid = [["F" if rng.random() < frozen else "H" for _ in range(size)]
                for _ in range(size)]
        if ends == "random":
            cells = rng.sample(range(size * size), 2)
            (sr, sc), (gr, gc) = (divmod(cell, size) for cell in cells)
        else:
            (sr, sc), (gr, gc) = (0, 0), (size - 1, size - 1)
        grid[sr][sc], grid[gr][gc] = "S", "G"
        rows = ["".join(row) for row in grid]
        if has_path(rows):
            return rows


def ragen_text(desc: list[list[bytes]] | list[str], position: int) -> str:
    """The map as RAGEN draws it, with the player at ``position`` (row-major index)."""
    rows = [[c.decode() if isinstance(c, bytes) else c for c in row] for row in desc]
    width = len(rows[0])
    r, c = divmod(position, width)
    cells = [[RAGEN_CELLS[cell] for cell in row] for row in rows]
    cells[r][c] = {"H": "X", "G": "√"}.get(rows[r][c], "P")
    return "\n".join("".join(row) for row in cells)


def chained_actions(text: str, names: list[str], most: int) -> list[int]:
    """Up to ``most`` action indices from a reply: the last ``<answer>`` block (else the
    whole reply) split on ``||``, each piece's last legal action name; pieces without one
    are skipped."""
    answers = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S | re.I)
    pieces = (answers[-1] if answers else text).split("||")
    found = []
    for piece in pieces:
        words = [w for w in re.findall(r"[a-z]+", piece.lower()) if w in names]
        if words:
            found.append(names.index(words[-1]))
    return found[:most]


def lake_prompt(settings: LakeSettings, slippery: bool) -> str:
    """The system prompt of a FrozenLake played with chained moves or RAGEN's text."""
    legend = ("P is you, _ frozen ice, O a hole, G the goal (X: you fell in a hole, √: you "
              "reached the goal)." if settings.render == "ragen"
              else "@ is you, F frozen, H a hole, G the goal.")
    names = RAGEN_NAMES if settings.render == "ragen" else ["left", "down", "right", "up"]
    ice = " The ice is slippery: a move may slide you to either side of it." if slippery else ""
    k = settings.actions_per_turn
    reply = (f"Reply with up to {k} moves separated by ||, each one of: {'/'.join(names)}; "
             f"for example <answer>{names[0]} || {names[3]}</answer>." if k > 1
             else f"Reply with one action: {'/'.join(names)}.")
    return f"You are playing FrozenLake: reach the goal without falling in a hole. {legend}" \
           f"{ice} {reply}"
