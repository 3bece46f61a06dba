"""A partially observed maze: the agent sees only which directions are open where it stands.

The maze is a random spanning tree of the grid (depth-first carving), so every cell is
reachable; the goal is the cell farthest from the start. Only reaching the goal pays.
"""

from __future__ import annotations

import random
import re
from collections import deque

from turnrl.envs.base import StepResult, register_env

Cell = tuple[int, int]

MOVES = {"north": (-1, 0), "south": (1, 0), "east": (0, 1), "west": (0, -1)}
"""Direction -> (row, column) step, row 0 being the north edge; also the order they are listed."""
ALIASES = {"n": "north", "s": "south", "e": "east", "w": "west",
           "up": "north", "down": "south", "right": "east", "left": "west"}


def step_from(cell: Cell, direction: str) -> Cell:
    dr, dc = MOVES[direction]
    return cell[0] + dr, cell[1] + dc


def carve(size: int, rng: random.Random) -> dict[Cell, set[str]]:
    """A perfect maze: cell -> directions open from it (iterative randomized DFS)."""
    opened: dict[Cell, set[str]] = {(r, c): set() for r in range(size) for c in range(size)}
    start = (rng.randrange(size), rng.randrange(size))
    stack, seen = [start], {start}
    while stack:
        cell = stack[-1]
        fresh = [d for d in MOVES if step_from(cell, d) in opened and step_from(cell, d) not in seen]
        if not fresh:
            stack.pop()
            continue
        d = rng.choice(fresh)
        nxt = step_from(cell, d)
        opened[cell].add(d)
        opened[nxt].add(next(b for b in MOVES if step_from(nxt, b) == cell))
        seen.add(nxt)
        stack.append(nxt)
    return opened


def distances(opened: dict[Cell, set[str]], source: Cell) -> dict[Cell, int]:
    """Moves from ``source`` to every cell (breadth-first)."""
    dist, queue = {source: 0}, deque([source])
    while queue:
        cell = queue.popleft()
        for d in opened[cell]:
            nxt = step_from(cell, d)
            if nxt not in dist:
                dist[nxt] = dist[cell] + 1
                queue.append(nxt)
    return dist


def parse_direction(action: str) -> str | None:
    """The one direction named in ``action`` ("go North!", "n"), else None."""
    words = re.findall(r"[a-z]+", action.lower())
    # a lone letter is a direction only as the whole reply: "let's" must not read as south
    named = {ALIASES.get(w, w) for w in words if len(w) > 1 or len(words) == 1} & MOVES.keys()
    return named.pop() if len(named) == 1 else None


@register_env("maze")
class Maze:
    """Multi-turn: walk a seeded maze to the goal seeing only open directions (LMRL-Gym maze).

    The partially observed maze of LMRL-Gym (Abdulhai et al. 2023, arXiv:2311.18232), but a
    fresh ``size`` x ``size`` maze per seed. Each observation lists the open directions, and
    "goal: east" when the goal is one open step away. A move into a wall or an unreadable
    reply wastes a turn. Reaching the goal pays ``1 - turn_cost * (turns - 1)``.
    ``max_turns`` defaults to 2 * (size * size - 1), enough for depth-first exploration to
    visit every cell. ``info["state_key"]`` is the position, "row,column".
    """

    cooperative = True  # pure Python, never blocks: shares one env thread

    system_prompt = ("You are in a maze and must find the goal. Each turn reply with one "
                     "direction: north, south, east or west.")

    def __init__(self, size: int = 3, max_turns: int | None = None, turn_cost: float = 0.01):
        if size < 2:
            raise ValueError("size must be at least 2")
        self.size, self.turn_cost = size, turn_cost
        self.max_turns = max_turns or 2 * (size * size - 1)
        self.opened: dict[Cell, set[str]] = {}
        self.pos = self.goal = (0, 0)
        self.turn = 0

    @property
    def state_key(self) -> str:
        return f"{self.pos[0]},{self.pos[1]}"

    def view(self) -> str:
        """What the agent sees from its cell, e.g. "open: north, east. goal: east"."""
        open_dirs = [d for d in MOVES if d in self.opened[self.pos]]
        text = f"open: {', '.join(open_dirs)}"
        near = [d for d in open_dirs if step_from(self.pos, d) == self.goal]
        return f"{text}. goal: {near[0]}" if near else text

    async def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.opened = carve(self.size, rng)
        self.pos = (rng.randrange(self.size), rng.randrange(self.size))
        dist = distances(self.opened, self.pos)
        farthest = max(dist.values())
        self.goal = rng.choice(sorted(c for c, n in dist.items() if n == farthest))
        self.turn = 0
        return f"Find the goal in {self.max_turns} moves. {self.view()}"

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        direction = parse_direction(action)
        if direction is None:
            reply = f"Say north, south, east or west. {self.view()}"
        elif direction not in self.opened[self.pos]:
            reply = f"Wall. {self.view()}"
        else:
            self.pos = step_from(self.pos, direction)
            if self.pos == self.goal:
                reward = max(0.0, 1.0 - self.turn_cost * (self.turn - 1))
                info = {"success": True, "turns": self.turn, "state_key": self.state_key}
                return StepResult("You found the goal!", reward, True, info)
            reply = self.view()
        info = {"success": False, "turns": self.turn, "state_key": self.state_key}
        return StepResult(reply, 0.0, self.turn >= self.max_turns, info)
