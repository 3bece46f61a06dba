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

``protocol ragen`` plays the room as RAGEN's ``SimpleSokoban`` (github.com/RAGEN-AI/RAGEN at
5eb79b8, 2025-09-06): ``config/envs.yaml`` (``dim_x 6, dim_y 6, num_boxes 1``,
``max_actions_per_traj 10``, ``max_tokens 100``), ``config/base.yaml`` (``max_turn 5``,
``max_actions_per_turn 5``, ``action_sep "||"``; validation 256 rooms, one per seed,
temperature 0.5), ``ragen/env/sokoban/config.py`` (``search_depth 300``) and
``ragen/env/sokoban/utils.py`` (the room: gym-sokoban's generator). That generator, written
here from its idea (``room carved``): floor carved by a random walk that opens a small
shape at each step (1.7 x (width + height) steps), boxes on random targets, then reverse play
from the solved room keeping the placement whose boxes lie farthest from their targets,
then the player walked up to three random steps. A reply may chain up to
``actions_per_turn`` moves split by ``||`` (inside the last ``<answer>...</answer>`` when
there is one); a blocked move is spent and does nothing, as in gym-sokoban; the episode
also ends after ``max_actions`` moves. Departures: TurnRL's own draws (not RAGEN's room for
the same seed), no -0.1/+1/+10 shaping (success is the signal), no format penalty, lenient
reading (any case, no ``<think>`` required), the instruction written here.
"""

from __future__ import annotations

import random
import re
from collections import deque

from turnrl.envs.base import StepResult, register_env

Cell = tuple[int, int]
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
RAGEN = {"size": 6, "boxes": 1, "room": "carved", "search_depth": 300, "max_turns": 5,
         "actions_per_turn": 5, "max_actions": 10}
"""``protocol ragen``: RAGEN's SimpleSokoban (the module docstring says where each is set)."""
PROTOCOLS = {"ragen": RAGEN}
SHAPES = [((0, -1), (0, 0), (0, 1)), ((-1, 0), (0, 0), (1, 0)), ((0, 0), (0, 1), (1, 0)),
          ((0, 0), (0, 1), (1, 0), (1, 1))]
"""What one step of the carving walk opens around it: a bar across, a bar down, a corner, a
block."""


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


def carve(size: int, rng: random.Random) -> frozenset[Cell]:
    """Floor cells opened by a random walk inside the walls: 1.7 x (2 size) steps, turning
    with probability 0.35, each opening one of ``SHAPES`` (gym-sokoban's topology idea)."""
    inner = range(1, size - 1)
    (r, c), (dr, dc) = (rng.choice(inner), rng.choice(inner)), rng.choice(list(MOVES.values()))
    floor = set()
    for _ in range(int(1.7 * 2 * size)):
        if rng.random() < 0.35:
            dr, dc = rng.choice(list(MOVES.values()))
        r, c = min(max(r + dr, 1), size - 2), min(max(c + dc, 1), size - 2)
        floor |= {(r + a, c + b) for a, b in rng.choice(SHAPES)
                  if r + a in inner and c + b in inner}
    return frozenset(floor)


def farthest_pull(floor: frozenset[Cell], targets: tuple[Cell, ...], player: Cell, depth: int,
                  rng: random.Random) -> tuple[tuple[Cell, ...], Cell]:
    """(boxes, player) reachable from the solved room by up to ``depth`` reverse moves (a
    move away from a box may pull it along), with the boxes farthest (summed Manhattan
    distance, box i from target i) from their targets; ties drawn at random."""
    start = (targets, player)
    seen, frontier = {start: 0}, deque([start])
    while frontier:
        boxes, at = state = frontier.popleft()
        if seen[state] >= depth:
            continue
        for dr, dc in MOVES.values():
            ahead, behind = (at[0] + dr, at[1] + dc), (at[0] - dr, at[1] - dc)
            if ahead not in floor or ahead in boxes:
                continue
            options = [boxes] + ([tuple(at if b == behind else b for b in boxes)]
                                 if behind in boxes else [])
            for moved in options:
                if (moved, ahead) not in seen:
                    seen[(moved, ahead)] = seen[state] + 1
                    frontier.append((moved, ahead))

    def spread(boxes: tuple[Cell, ...]) -> int:
        return sum(abs(b[0] - t[0]) + abs(b[1] - t[1])
                   for b, t in zip(boxes, targets, strict=True))

    best = max(spread(boxes) for boxes, _ in seen)
    return rng.choice(sorted(s for s in seen if spread(s[0]) == best))


def wander(floor: frozenset[Cell], boxes: frozenset[Cell], player: Cell, chance: float,
           rng: random.Random) -> Cell:
    """The player after up to three random steps to new free cells (with ``chance``, each
    further step with 1/2), so it does not always start beside the box it last pulled."""
    if rng.random() >= chance:
        return player
    visited = [player]
    for _ in range(3):
        free = [shifted(player, m) for m in MOVES]
        free = [cell for cell in free if cell in floor and cell not in boxes
                and cell not in visited]
        if not free:
            break
        player = rng.choice(free)
        visited.append(player)
        if rng.random() >= 0.5:
            break
    return player


def generate_carved(size: int, boxes: int, depth: int, rng: random.Random
                    ) -> tuple[frozenset[Cell], frozenset[Cell], frozenset[Cell], Cell]:
    """(floor, targets, boxes, player) of a carved room (module docstring, ``room carved``):
    redrawn until the room has space and the farthest pull moves a box."""
    for _ in range(1000):
        floor = carve(size, rng)
        cells = sorted(floor)
        if len(cells) <= boxes + 1:
            continue
        rng.shuffle(cells)
        targets = tuple(cells[:boxes])
        placed, player = farthest_pull(floor, targets, cells[boxes], depth, rng)
        moved = sum(b != t for b, t in zip(placed, targets, strict=True))
        if moved:
            chance = 0.8 if moved == 1 and boxes == 1 else 0.5
            return floor, frozenset(targets), frozenset(placed), wander(
                floor, frozenset(placed), player, chance, rng)
    raise ValueError(f"sokoban: no carved room of size {size} with {boxes} boxes in 1000 draws")


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


def parse_moves(action: str, most: int) -> list[str]:
    """Up to ``most`` moves from a reply: the last ``<answer>`` block (else the whole reply)
    split on ``||``, each piece's last direction; pieces naming none are skipped."""
    answers = re.findall(r"<answer>(.*?)</answer>", action, flags=re.S | re.I)
    pieces = (answers[-1] if answers else action).split("||")
    return [move for move in map(parse_move, pieces) if move][:most]


PLAIN = {"size": 6, "boxes": 1, "room": "open", "search_depth": 300, "max_turns": 10,
         "actions_per_turn": 1, "max_actions": 0}
"""The room and budget without a protocol: one move a turn on open floor."""


def sokoban_settings(protocol: str, given: dict) -> dict:
    """The room and budget: ``PLAIN``, the protocol's values over it, the options given
    (not None) over both."""
    if protocol and protocol not in PROTOCOLS:
        raise ValueError(f"unknown sokoban protocol '{protocol}'; choose: {', '.join(PROTOCOLS)}")
    chosen = {**PLAIN, **PROTOCOLS.get(protocol, {}),
              **{k: v for k, v in given.items() if v is not None}}
    size, boxes = chosen["size"], chosen["boxes"]
    if size < 4 or boxes < 1 or (size - 2) ** 2 < boxes + 1:
        raise ValueError(f"sokoban: size {size} with {boxes} boxes does not fit; use size "
                         ">= 4 and fewer boxes than floor cells")
    if chosen["room"] not in ("open", "carved") or chosen["actions_per_turn"] < 1 \
            or chosen["max_actions"] < 0 or chosen["max_turns"] < 1:
        raise ValueError("sokoban: room open|carved, actions_per_turn >= 1, max_actions >= 0 "
                         "(0: no cap), max_turns >= 1")
    return chosen


@register_env("sokoban")
class Sokoban:
    """Push the box(es) onto the target(s) in a seeded ``size`` x ``size`` room (walls
    included), one move a turn; 1 when solved (RAGEN's Sokoban). Options left None take
    ``protocol``'s value (``ragen``: RAGEN's SimpleSokoban, a carved 6x6 room, one box, five
    turns of up to five moves, ten moves in all), else the plain one (6, 1 box, open floor,
    10 turns of one move). ``pulls``: random pulls of an open room; ``search_depth``: reverse
    moves searched for a carved one."""

    system_prompt = ("You are solving Sokoban. # wall, _ floor, O target, X box, √ box on "
                     "target, P you, S you on a target. Push every box onto a target. Reply "
                     "with one move: up, down, left or right.")

    def __init__(self, size: int | None = None, boxes: int | None = None, pulls: int = 20,
                 max_turns: int | None = None, step_penalty: float = 0.0,
                 room: str | None = None, search_depth: int | None = None,
                 actions_per_turn: int | None = None, max_actions: int | None = None,
                 protocol: str = ""):
        chosen = sokoban_settings(protocol, {
            "size": size, "boxes": boxes, "room": room, "search_depth": search_depth,
            "max_turns": max_turns, "actions_per_turn": actions_per_turn,
            "max_actions": max_actions})
        self.size, self.n_boxes, self.pulls = chosen["size"], chosen["boxes"], pulls
        self.room, self.search_depth = chosen["room"], chosen["search_depth"]
        self.max_turns, self.step_penalty = chosen["max_turns"], step_penalty
        self.per_turn, self.max_actions = chosen["actions_per_turn"], chosen["max_actions"]
        if self.per_turn > 1:
            self.system_prompt = self.system_prompt.replace(
                "Reply with one move: up, down, left or right.",
                f"Reply with up to {self.per_turn} moves (up, down, left, right) separated "
                "by ||, for example: Up || Left")
        self.turn = self.moves = 0

    async def reset(self, seed: int) -> str:
        if self.room == "open":
            rng = random.Random(f"sokoban:{self.size}:{self.n_boxes}:{self.pulls}:{seed}")
            drawn = generate(self.size, self.n_boxes, self.pulls, rng)
        else:
            rng = random.Random(f"sokoban-carved:{self.size}:{self.n_boxes}:"
                                f"{self.search_depth}:{seed}")
            drawn = generate_carved(self.size, self.n_boxes, self.search_depth, rng)
        self.floor, self.targets, self.boxes, self.player = drawn
        self.turn = self.moves = 0
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
        if self.per_turn == 1:
            return "\n".join(rows) + "\nYour move (up, down, left or right):"
        left = f", {self.max_actions - self.moves} left in all" if self.max_actions else ""
        return "\n".join(rows) + f"\nYour moves (up to {self.per_turn}{left}, split by ||):"

    @property
    def state_key(self) -> str:
        return f"{sorted(self.boxes)}|{self.player}"

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.per_turn == 1 and not self.max_actions:  # one move a turn, as before
            move = parse_move(action)
            moves = [move] if move else []
        else:
            moves = parse_moves(action, self.per_turn)
        blocked = False
        for move in moves:  # a blocked move is spent and changes nothing (gym-sokoban)
            moved = push(self.floor, self.boxes, self.player, move)
            if moved is not None:
                self.boxes, self.player = moved
            blocked, self.moves = moved is None, self.moves + 1
            if self.boxes == self.targets or self.moves == self.max_actions:
                break
        solved = self.boxes == self.targets
        done = solved or self.turn >= self.max_turns or self.moves == self.max_actions > 0
        reward = (1.0 if solved else 0.0) - self.step_penalty
        note = ("Name one move: up, down, left or right.\n" if not moves
                else "That move is blocked.\n" if blocked else "")
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
        """The plan's first move; with chained moves, as many as a turn and the budget take
        (``Up || Left``)."""
        env = self.env
        plan = solve(env.floor, env.targets, env.boxes, env.player) or ["up"]
        if env.per_turn == 1:
            return plan[0]
        most = min(env.per_turn, env.max_actions - env.moves) if env.max_actions \
            else env.per_turn
        return " || ".join(move.capitalize() for move in plan[:max(most, 1)])
