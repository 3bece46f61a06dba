"""``sokoban``: push every box onto a target, one move a turn (the puzzle RAGEN trains on).

Rooms are generated the way gym-sokoban does it in spirit (Schrader 2018), written here from
the idea: start from the solved room (each box on its target) and walk the player backwards
for ``pulls`` random moves, pulling a box whenever it stands behind the player. Every pull
undone is a push, so each room is solvable by construction; a room whose boxes all end on
their targets again is drawn anew. Departure: the room is open floor inside its walls
(gym-sokoban first carves a random room shape). Text as RAGEN renders it (Wang et al. 2025, "RAGEN:
Understanding Self-Evolution in LLM Agents via Multi-Turn Reinforcement Learning",
arXiv:2504.20073): ``#`` wall, ``_`` floor, ``O`` target, ``X`` box, ``√`` box on target,
``P`` player, ``S`` player on target.

Reward: ``-step_penalty`` a move, 1 when the last box lands (RAGEN pays -0.1 a move, +1 a box
placed and +10 solved; here success is the signal and shaping is an option). A reply naming no
single direction wastes its turn. ``reference_player()`` is a breadth-first solver over
(player, boxes) states, so guidance and scripted demonstrations work.
"""

from __future__ import annotations

import random
import re
from collections import deque

from turnrl.envs.base import StepResult, register_env

Cell = tuple[int, int]
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def shifted(cell: Cell, move: str, times: int = 1) -> Cell:
    dr, dc = MOVES[move]
    return cell[0] + dr * times, cell[1] + dc * times


def generate(size: int, boxes: int, pulls: int, rng: random.Random
             ) -> tuple[frozenset[Cell], frozenset[Cell], frozenset[Cell], Cell]:
    """(floor cells, targets, boxes, player) of a solvable room: the solved room walked back
    ``pulls`` random moves (module docstring)."""
    floor = frozenset((r, c) for r in range(1, size - 1) for c in range(1, size - 1))
    for _ in range(1000):
        cells = sorted(floor)
        rng.shuffle(cells)
        targets, player = frozenset(cells[:boxes]), cells[boxes]
        placed = set(targets)
        for _ in range(pulls):
            move = rng.choice(list(MOVES))
            ahead = shifted(player, move)
            if ahead not in floor or ahead in placed:
                continue
            behind = shifted(player, move, -1)  # the box behind the player comes along
            if behind in placed:
                placed.remove(behind)
                placed.add(player)
            player = ahead
        if placed != targets:
            return floor, targets, frozenset(placed), player
    raise ValueError(f"sokoban: no unsolved room of size {size} with {boxes} boxes in 1000 "
                     "draws; raise pulls or size")


def push(floor: frozenset[Cell], boxes: frozenset[Cell], player: Cell, move: str
         ) -> tuple[frozenset[Cell], Cell] | None:
    """The boxes and player after ``move``, or None when a wall or a blocked box stops it."""
    ahead = shifted(player, move)
    if ahead not in floor:
        return None
    if ahead in boxes:
        beyond = shifted(ahead, move)
        if beyond not in floor or beyond in boxes:
            return None
        boxes = (boxes - {ahead}) | {beyond}
    return boxes, ahead


def solve(floor: frozenset[Cell], targets: frozenset[Cell], boxes: frozenset[Cell],
          player: Cell, limit: int = 200_000) -> list[str] | None:
    """The shortest move list that solves the room (breadth-first), None beyond ``limit``
    states or when there is none."""
    start = (boxes, player)
    parent: dict = {start: None}
    queue = deque([start])
    while queue and len(parent) < limit:
        state = queue.popleft()
        if state[0] == targets:
            path = []
            while parent[state] is not None:
                state, move = parent[state]
                path.append(move)
            return path[::-1]
        for move in MOVES:
            nxt = push(floor, state[0], state[1], move)
            if nxt is not None and nxt not in parent:
                parent[nxt] = (state, move)
                queue.append(nxt)
    return None


def parse_move(action: str) -> str | None:
    """The one direction the reply names (its last word naming one), else None."""
    named = [w for w in re.findall(r"[a-z]+", action.lower()) if w in MOVES]
    return named[-1] if named else None


@register_env("sokoban")
class Sokoban:
    """Push the box(es) onto the target(s) in a seeded ``size`` x ``size`` room (walls
    included), one move a turn; 1 when solved (RAGEN's Sokoban)."""

    system_prompt = ("You are solving Sokoban. # wall, _ floor, O target, X box, √ box on "
                     "target, P you, S you on a target. Push every box onto a target. Reply "
                     "with one move: up, down, left or right.")

    def __init__(self, size: int = 6, boxes: int = 1, pulls: int = 20, max_turns: int = 10,
                 step_penalty: float = 0.0):
        if size < 4 or boxes < 1 or (size - 2) ** 2 < boxes + 1:
            raise ValueError(f"sokoban: size {size} with {boxes} boxes does not fit; use size "
                             ">= 4 and fewer boxes than floor cells")
        self.size, self.n_boxes, self.pulls = size, boxes, pulls
        self.max_turns, self.step_penalty = max_turns, step_penalty
        self.turn = 0

    async def reset(self, seed: int) -> str:
        rng = random.Random(f"sokoban:{self.size}:{self.n_boxes}:{self.pulls}:{seed}")
        self.floor, self.targets, self.boxes, self.player = generate(
            self.size, self.n_boxes, self.pulls, rng)
        self.turn = 0
        return self.render()

    def render(self) -> str:
        def symbol(cell: Cell) -> str:
            if cell not in self.floor:
                return "#"
            target = cell in self.targets
            if cell == self.player:
                return "S" if target else "P"
            if cell in self.boxes:
                return "√" if target else "X"
            return "O" if target else "_"

        rows = ["".join(symbol((r, c)) for c in range(self.size)) for r in range(self.size)]
        return "\n".join(rows) + "\nYour move (up, down, left or right):"

    @property
    def state_key(self) -> str:
        return f"{sorted(self.boxes)}|{self.player}"

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        move = parse_move(action)
        moved = push(self.floor, self.boxes, self.player, move) if move else None
        if moved is not None:
            self.boxes, self.player = moved
        solved = self.boxes == self.targets
        done = solved or self.turn >= self.max_turns
        reward = (1.0 if solved else 0.0) - self.step_penalty
        note = "" if moved is not None else (
            "That move is blocked.\n" if move else "Name one move: up, down, left or right.\n")
        return StepResult("" if done else note + self.render(), reward, done,
                          {"success": solved, "state_key": self.state_key})

    def reference_player(self) -> SokobanSolver:
        return SokobanSolver(self)


class SokobanSolver:
    """The oracle: the first move of a shortest solution from the room as it stands."""

    def __init__(self, env: Sokoban) -> None:
        self.env = env

    def reset(self, first_observation: str) -> None:
        pass

    def act(self, observation: str) -> str:
        env = self.env
        plan = solve(env.floor, env.targets, env.boxes, env.player)
        return plan[0] if plan else "up"
