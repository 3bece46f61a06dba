"""TicTacToe against a fixed opponent, exact rules, offline.

The policy plays X (moves first), O, or either by the seed's parity (``role: both``, so one
run trains both roles). The opponent lives in the env: ``skill`` 1 is perfect play
(minimax), 0 a uniformly random legal move, and values between play minimax with that
probability each move, a difficulty knob for curricula. Moves are cell numbers 1-9; the
board shows an empty cell as its number.

Rewards are zero-sum from the policy's side: win 1, draw 0, loss -1. An illegal reply (no
cell number, or a taken cell) loses the game at once, the usual tournament rule, with the
reason in ``info["reason"]``. ``info`` also names the ``role``, the ``opponent`` and the
``outcome`` (win, draw, loss, illegal); ``success`` is a win. Against perfect play the best
result is a draw, so evaluate against ``skill`` below 1 (or count draws) to see progress.

``opponent`` picks who plays the other side: ``scripted`` (the ``skill`` player above, the
default), ``minimax`` (skill 1), ``random`` (skill 0), ``pool`` or ``model`` (an outside player
handed over with ``set_opponent``: the trainer's frozen past policies, or another local
model, turnrl/selfplay/; its illegal reply forfeits the game to the policy) or ``self``: the policy plays both seats of one game
(``seats`` X and O, envs/contract.py), one episode per seat, zero-sum (docs/selfplay.md).
"""

from __future__ import annotations

import random
from functools import cache

from turnrl.envs.base import StepResult, register_env
from turnrl.rewards import first_integer

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
EMPTY = "."


def winner(board: str) -> str | None:
    """"X" or "O" when that mark holds a line, else None. ``board``: 9 chars of X, O, '.'."""
    for a, b, c in LINES:
        if board[a] != EMPTY and board[a] == board[b] == board[c]:
            return board[a]
    return None


def legal_moves(board: str) -> list[int]:
    """Empty cells, 0-based."""
    return [i for i, mark in enumerate(board) if mark == EMPTY]


def to_move(board: str) -> str:
    return "X" if board.count("X") == board.count("O") else "O"


@cache
def minimax_value(board: str) -> int:
    """The game's value for the player to move under perfect play: 1 win, 0 draw, -1 loss."""
    won = winner(board)
    if won is not None:
        return -1  # the previous move won: the player to move has lost
    moves = legal_moves(board)
    if not moves:
        return 0
    mark = to_move(board)
    return max(-minimax_value(_play(board, move, mark)) for move in moves)


def best_moves(board: str) -> list[int]:
    """Every move that keeps the best value for the player to move (0-based cells)."""
    mark = to_move(board)
    values = {move: -minimax_value(_play(board, move, mark)) for move in legal_moves(board)}
    best = max(values.values())
    return [move for move, value in values.items() if value == best]


def _play(board: str, move: int, mark: str) -> str:
    return board[:move] + mark + board[move + 1:]


def render(board: str) -> str:
    """The board as the model reads it; empty cells show their number (1-9)."""
    cells = [mark if mark != EMPTY else str(i + 1) for i, mark in enumerate(board)]
    rows = [" " + " | ".join(cells[r * 3:r * 3 + 3]) for r in range(3)]
    return "\n---+---+---\n".join(rows)


OPPONENTS = ("scripted", "minimax", "random", "pool", "model", "endpoint", "self")
OUTSIDE = ("pool", "model", "endpoint")
"""Opponents that are an outside player handed over with ``set_opponent``."""
OUTCOME_TEXT = {"win": "You win.", "loss": "You lose.", "draw": "Draw.",
                "illegal": "Illegal move: you lose."}


def other_mark(mark: str) -> str:
    return "O" if mark == "X" else "X"


def parse_move(text: str, board: str) -> tuple[int | None, str]:
    """(the 0-based cell a reply names, "") when it is legal on ``board``, else (None, why)."""
    cell = first_integer(text)
    if cell is None or not 1 <= cell <= 9:
        return None, "no cell number in the reply"
    if board[cell - 1] != EMPTY:
        return None, f"cell {cell} is taken"
    return cell - 1, ""


def seat_view(board: str, mark: str) -> str:
    """The whole state as one prompt, for an outside player who answers each move afresh."""
    return f"You play {mark}.\n{render(board)}\nYour move?"


class MinimaxPlayer:
    """Perfect play for whichever side is to move, reading the env's board (a reference
    player: ``reset``/``act`` as in envs/reference.py)."""

    def __init__(self, env: TicTacToe) -> None:
        self.env = env

    def reset(self, first_observation: str) -> None:
        pass

    def act(self, observation: str) -> str:
        return str(best_moves(self.env.board)[0] + 1)


@register_env("tictactoe")
class TicTacToe:
    """TicTacToe against a built-in opponent; moves are cell numbers 1-9.

    role: x (moves first), o, or both (by the seed's parity). skill: the opponent plays the
    minimax move with this probability, else a random legal one (1 perfect, 0 random).
    opponent: scripted (the skill player), minimax, random, pool (frozen past policies, set by
    the trainer), model (another local model: env.opponent_model), endpoint (an OpenAI-compatible
    endpoint: env.opponent_endpoint) or self (self-play: the policy plays X and O, one episode per seat).
    Reward: win 1, draw 0, loss -1; an illegal move loses. success: a win.
    """

    cooperative = True  # pure Python, never blocks

    system_prompt = ("You are playing TicTacToe. Cells are numbered 1-9, left to right, top to "
                     "bottom. Reply with the number of one empty cell only.")

    zero_sum = True  # self-play: the seats' rewards sum to zero (checked by the turn loop)
    eval_opponents = ("random", "minimax")  # what a self-play or pool run is evaluated against

    def __init__(self, role: str = "both", skill: float = 1.0,
                 opponent: str = "scripted") -> None:
        if role not in ("x", "o", "both"):
            raise ValueError(f"tictactoe role must be x, o or both, got {role!r}")
        if not 0 <= skill <= 1:
            raise ValueError(f"tictactoe skill must be in [0, 1], got {skill!r}")
        if opponent not in OPPONENTS:
            raise ValueError(f"tictactoe opponent must be one of {', '.join(OPPONENTS)}, "
                             f"got {opponent!r}")
        skill = {"minimax": 1.0, "random": 0.0}.get(opponent, skill)
        self.role_option, self.skill, self.opponent_option = role, skill, opponent
        self.board, self.mark, self.rng = EMPTY * 9, "X", random.Random(0)
        self.seats = ("X", "O") if opponent == "self" else ()
        self.player, self.opponent_error = None, ""
        self.moves: list[tuple[str, int]] = []
        self.outcomes: dict[str, str] = {}
        # an outside player may run a model on this env's thread: not cooperative then
        self.cooperative = opponent not in OUTSIDE

    def set_opponent(self, player) -> None:
        """Play ``player`` (``act(system_prompt, observation) -> str``, and a ``name``) in the
        other seat (``opponent: pool``)."""
        self.player = player

    @property
    def opponent(self) -> str:
        if self.opponent_option == "self":
            return "self"
        if self.opponent_option in OUTSIDE:
            return getattr(self.player, "name", self.opponent_option)
        return {1.0: "minimax", 0.0: "random"}.get(float(self.skill), f"skill-{self.skill:g}")

    @property
    def state_key(self) -> str:
        return f"{self.mark}:{self.board}"

    def reference_player(self) -> MinimaxPlayer:
        return MinimaxPlayer(self)

    async def reset(self, seed: int) -> str:
        self.rng = random.Random(seed)
        if self.seats:
            self.board, self.mark, self.moves, self.outcomes = EMPTY * 9, "X", [], {}
            return self.observe("X")
        self.opponent_error = ""
        self.mark = {"x": "X", "o": "O"}.get(self.role_option) or ("X" if seed % 2 == 0 else "O")
        self.board = EMPTY * 9
        opening = ""
        if self.mark == "O":
            move = self._opponent_move()
            if move is None:  # an outside player forfeited before the policy moved
                opening = f"X (your opponent) made an illegal move ({self.opponent_error}).\n"
            else:
                opening = f"X (your opponent) played {move + 1}.\n"
        return (f"You play {self.mark}; {'you move first' if self.mark == 'X' else 'X moved first'}."
                f"\n{opening}{render(self.board)}\nYour move?")

    def _opponent_move(self) -> int | None:
        """Play the opponent's move; its cell, or None when an outside player's reply was
        illegal (it forfeits)."""
        mover = to_move(self.board)
        if self.opponent_option in OUTSIDE:
            if self.player is None:
                raise RuntimeError(f"tictactoe opponent '{self.opponent_option}' has no player: the trainer hands "
                                   "one over (set_opponent); evaluate against minimax or random")
            move, self.opponent_error = parse_move(
                self.player.act(self.system_prompt, seat_view(self.board, mover)), self.board)
            if move is None:
                return None
        elif self.rng.random() < self.skill:
            move = self.rng.choice(best_moves(self.board))
        else:
            move = self.rng.choice(legal_moves(self.board))
        self.board = _play(self.board, move, mover)
        return move

    def _info(self, outcome: str | None, **more) -> dict:
        info = {"role": self.mark, "opponent": self.opponent, "state_key": self.state_key,
                "success": outcome == "win", **more}
        if outcome is not None:
            info["outcome"] = outcome
        return info

    async def step(self, action: str) -> StepResult:
        if self.seats:
            return self._seat_step(action)
        if self.opponent_option in OUTSIDE and self.opponent_error:
            # the outside player forfeited on its first move (the policy plays O)
            return StepResult("You win: your opponent's move was illegal.", 1.0, True,
                              self._info("win", reason=f"opponent's illegal move: "
                                                       f"{self.opponent_error}"))
        cell = first_integer(action)
        if cell is None or not 1 <= cell <= 9 or self.board[cell - 1] != EMPTY:
            why = ("no cell number in the reply" if cell is None or not 1 <= cell <= 9
                   else f"cell {cell} is taken")
            return StepResult(f"Illegal move ({why}): you lose.", -1.0, True,
                              self._info("illegal", reason=f"illegal move: {why}"))
        self.board = _play(self.board, cell - 1, self.mark)
        if winner(self.board) == self.mark:
            return StepResult("You win.", 1.0, True, self._info("win"))
        if not legal_moves(self.board):
            return StepResult("Draw.", 0.0, True, self._info("draw"))
        reply = self._opponent_move()
        other = "O" if self.mark == "X" else "X"
        if reply is None:
            return StepResult(f"{other}'s reply was illegal: you win.", 1.0, True,
                              self._info("win", reason=f"opponent's illegal move: "
                                                       f"{self.opponent_error}"))
        text = f"{other} played {reply + 1}.\n{render(self.board)}"
        if winner(self.board) == other:
            return StepResult(f"{text}\nYou lose.", -1.0, True, self._info("loss"))
        if not legal_moves(self.board):
            return StepResult(f"{text}\nDraw.", 0.0, True, self._info("draw"))
        return StepResult(f"{text}\nYour move?", 0.0, False, self._info(None))

    # ---- self-play: both seats are the policy (``opponent: self``) ------------------------

    @property
    def seat_to_move(self) -> str:
        return to_move(self.board)

    def observe(self, seat: str) -> str:
        """What ``seat`` reads now: the opening before its first move, the other seat's move
        since its own last one, the board, and "Your move?" or how the game ended for it."""
        mine = [i for i, (mark, _) in enumerate(self.moves) if mark == seat]
        lines = [] if mine else [f"You play {seat}; "
                                 f"{'you move first' if seat == 'X' else 'X moved first'}."]
        since = mine[-1] + 1 if mine else 0
        lines += [f"{mark} played {cell + 1}." for mark, cell in self.moves[since:]]
        lines.append(render(self.board))
        lines.append(OUTCOME_TEXT[self.outcomes[seat]] if self.outcomes else "Your move?")
        return "\n".join(lines)

    def _seat_step(self, action: str) -> StepResult:
        """The move of the seat to move; when it ends the game, every seat's reward."""
        mover = to_move(self.board)
        other = other_mark(mover)
        move, why = parse_move(action, self.board)
        if move is None:
            return self._game_over({mover: "illegal", other: "win"},
                                   {mover: f"illegal move: {why}",
                                    other: f"opponent's illegal move: {why}"})
        self.board = _play(self.board, move, mover)
        self.moves.append((mover, move))
        self.mark = to_move(self.board)  # state_key names the seat to move
        if winner(self.board) == mover:
            return self._game_over({mover: "win", other: "loss"})
        if not legal_moves(self.board):
            return self._game_over({mover: "draw", other: "draw"})
        return StepResult(render(self.board), 0.0, False, {"state_key": self.state_key})

    def _game_over(self, outcomes: dict[str, str], reasons: dict[str, str] | None = None
                   ) -> StepResult:
        self.outcomes = outcomes
        reward = {"win": 1.0, "draw": 0.0, "loss": -1.0, "illegal": -1.0}
        seats = {seat: {"reward": reward[outcome], "role": seat, "opponent": "self",
                        "outcome": outcome, "success": outcome == "win",
                        **({"reason": reasons[seat]} if reasons else {})}
                 for seat, outcome in outcomes.items()}
        mover = next(iter(outcomes))
        return StepResult(OUTCOME_TEXT[outcomes[mover]], seats[mover]["reward"], True,
                          {"seats": seats})


@register_env("tictactoe-selfplay")
def tictactoe_selfplay(opponent: str = "self", skill: float = 1.0) -> TicTacToe:
    """TicTacToe self-play: the policy plays X and O, one episode per seat (zero-sum).

    Win 1, draw 0, loss -1; an illegal move loses. Evaluated against random and
    minimax opponents, per role. opponent: self, or any of ``tictactoe``'s (pool: frozen past
    policies). docs/selfplay.md."""
    return TicTacToe(skill=skill, opponent=opponent)
