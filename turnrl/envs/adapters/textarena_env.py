"""TextArena games, one move a turn, offline.

``textarena``: single-player games (GuessTheNumber-v0, Wordle-v0, TowerOfHanoi-v0, ...).
``textarena-2p`` / ``textarena-selfplay``: two-player games (TicTacToe-v0, ConnectFour-v0,
KuhnPoker-v0, Nim-v0, ...) against a fixed or outside opponent, or self-play (below).
No TextArena online play: an opponent is a local player or an endpoint TurnRL calls.

Single-player: the first observation is TextArena's own prompt; later ones are what the game
appended after the move. The reward is TextArena's reward for player 0 at the end; success
when it is positive.
"""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

from turnrl.envs.base import StepResult, register_env


def require_textarena() -> Any:
    try:
        import textarena
    except ImportError:
        raise ImportError("textarena is not installed; run: pip install 'turnrl[envs]' "
                          "(or pip install textarena)") from None
    return textarena


@register_env("textarena")
class TextArena:
    """Multi-turn: a single-player TextArena game (game=GuessTheNumber-v0, Wordle-v0, ...)."""

    def __init__(self, game: str = "GuessTheNumber-v0", **game_options: Any):
        self.ta = require_textarena()
        self.game, self.game_options = game, game_options
        self.env: Any = None
        self.seen = ""

    def observe(self) -> str:
        _, obs = self.env.get_observation()
        text = obs if isinstance(obs, str) else "\n".join(str(part[1]) for part in obs)
        new = text[len(self.seen):] if text.startswith(self.seen) else text
        self.seen = text
        return new.strip()

    async def reset(self, seed: int) -> str:
        self.env = self.ta.make(self.game, **self.game_options)
        await asyncio.to_thread(self.env.reset, num_players=1, seed=seed)
        self.seen = ""
        return self.observe()

    async def step(self, action: str) -> StepResult:
        done, _ = await asyncio.to_thread(self.env.step, action)
        if not done:
            return StepResult(self.observe(), 0.0, False, {"success": False})
        rewards, _ = self.env.close()
        reward = float(rewards[0]) if rewards else 0.0
        return StepResult("", reward, True, {"success": reward > 0})


# --------------------------------------------------------------------- two-player games

GAME_SENDER = "GAME"
TWO_PLAYER_OPPONENTS = ("random", "self", "pool", "model", "endpoint")
OUTSIDE_PLAYERS = ("pool", "model", "endpoint")
"""Opponents that are an outside player handed over with ``set_opponent`` (turnrl/selfplay/)."""
QUOTED_MOVE = re.compile(r"'(\[[^\]\n]{1,40}\])'")
MAX_OPPONENT_MOVES = 64
"""Opponent moves in a row before the adapter gives up on a game that never hands back."""


def seat_name(player_id: int) -> str:
    """TextArena's player id as a seat (a role): 0 -> player0."""
    return f"player{player_id}"


def format_messages(messages: list, role_mapping: dict) -> str:
    """TextArena's raw observation messages (sender id, text, kind) as the text its own LLM
    wrapper shows: one ``[SENDER] text`` line each, the game itself as ``[GAME]``."""
    lines = []
    for message in messages:
        sender, text = message[0], message[1]
        name = GAME_SENDER if sender == -1 else role_mapping.get(sender, f"Player {sender}")
        lines.append(f"[{name}] {text}")
    return "\n".join(lines)


def offered_moves(observation: str) -> list[str]:
    """The moves the game last offered as quoted brackets on a line that names them available
    ("Available Moves: '[0]', '[4]'", "Your available actions are: '[check]', '[bet]'");
    [] when the game lists none (its rules' format examples are not moves)."""
    for line in reversed(observation.splitlines()):
        moves = QUOTED_MOVE.findall(line)
        if moves and "available" in line.lower():
            return moves
    return []


class RandomMover:
    """A random player for any TextArena game: one of the moves the game last offered, chosen
    uniformly (TicTacToe's and KuhnPoker's move lists); where the game lists none (ConnectFour,
    Nim) it replies ``[pass]`` and TextArena's invalid-move rule answers it (it forfeits)."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def act(self, system_prompt: str | None, observation: str) -> str:
        moves = offered_moves(observation)
        return self.rng.choice(moves) if moves else "[pass]"


def outcome_of(reward: float, invalid: bool) -> str:
    if invalid:
        return "illegal"
    return "win" if reward > 0 else "loss" if reward < 0 else "draw"


@register_env("textarena-2p")
class TextArenaTwoPlayer:
    """Multi-turn: a two-player TextArena game (game=TicTacToe-v0, ...) against an opponent.

    Offline, with TextArena's own rules and rewards (TicTacToe-v0, ConnectFour-v0,
    KuhnPoker-v0, Nim-v0, SimpleNegotiation-v0, ...).

    opponent: random (a move the game offers, default), self (self-play: the policy plays
    both seats, player0 and player1, one episode per seat), pool / model / endpoint (an
    outside player: frozen past policies, another local model, an OpenAI-compatible endpoint;
    docs/selfplay.md). seat: the policy's seat against a fixed opponent (0, 1, or both: by the
    seed's parity). An invalid move gets TextArena's rule (a chance to resubmit, then the
    mover loses); the reason is in info["reason"]. success: a positive reward.
    """

    system_prompt = ("You are playing a two-player game. Reply with your move only, in the "
                     "exact format the game asks for.")
    eval_opponents = ("random",)

    def __init__(self, game: str = "TicTacToe-v0", opponent: str = "random",
                 seat: str = "both", zero_sum: bool = True, **game_options: Any) -> None:
        if opponent not in TWO_PLAYER_OPPONENTS:
            raise ValueError(f"textarena-2p opponent must be one of "
                             f"{', '.join(TWO_PLAYER_OPPONENTS)}, got {opponent!r}")
        if str(seat) not in ("0", "1", "both"):
            raise ValueError(f"textarena-2p seat must be 0, 1 or both, got {seat!r}")
        self.ta = require_textarena()
        self.game, self.game_options = game, game_options
        self.opponent_option, self.seat_option = opponent, str(seat)
        self.zero_sum = bool(zero_sum)
        self.seats = (seat_name(0), seat_name(1)) if opponent == "self" else ()
        # an outside player may block on a model or a socket: never run on the event loop
        self.cooperative = False
        self.player: Any = None
        self.env: Any = None
        self.unread: dict[str, list[str]] = {}
        self.transcript: dict[str, list[str]] = {}
        self.mine = 0
        self.done = False

    def set_opponent(self, player: Any) -> None:
        """Play ``player`` (``act(system_prompt, observation) -> str`` and a ``name``) in the
        other seat (``opponent`` pool, model or endpoint)."""
        self.player = player

    @property
    def opponent(self) -> str:
        if self.opponent_option in OUTSIDE_PLAYERS:
            return getattr(self.player, "name", self.opponent_option)
        return self.opponent_option

    # ---- TextArena's state, read per seat -----------------------------------------------

    def _collect(self) -> None:
        """Move every player's new TextArena messages into that seat's unread text and its
        transcript (TextArena hands them out only to the player to move; the other seat's
        moves must reach each seat as its observation, so all are read here). TextArena
        echoes a move to its mover too: the policy's seat skips that echo (its reply is
        already in its conversation); the transcript, which a stateless outside player
        reads whole, keeps it."""
        state = self.env.state
        for player_id, messages in state.observations.items():
            if player_id < 0 or not messages:
                continue
            state.observations[player_id] = []
            seat = seat_name(player_id)
            news = [m for m in messages if m[0] != player_id]
            if news:
                self.unread.setdefault(seat, []).append(format_messages(news,
                                                                        state.role_mapping))
            self.transcript.setdefault(seat, []).append(format_messages(messages,
                                                                        state.role_mapping))

    def _take_unread(self, seat: str) -> str:
        text = "\n".join(self.unread.pop(seat, [])).strip()
        return text or "(no new messages)"

    def _start(self, seed: int) -> None:
        self.env = self.ta.make(self.game, **self.game_options)
        self.env.reset(num_players=2, seed=seed)
        self.unread, self.transcript, self.done = {}, {}, False
        self._collect()

    def _play(self, action: str) -> bool:
        done, _ = self.env.step(action)
        self._collect()
        self.done = bool(done)
        return self.done

    def _results(self) -> dict[str, dict]:
        """Each seat's reward and episode info from TextArena's ``close``."""
        rewards, game_info = self.env.close()
        rewards = rewards or {}
        results = {}
        for player_id in (0, 1):
            info = (game_info or {}).get(player_id, {})
            reward = float(rewards.get(player_id, 0.0))
            invalid = bool(info.get("invalid_move"))
            outcome = outcome_of(reward, invalid)
            entry = {"reward": reward, "role": seat_name(player_id), "outcome": outcome,
                     "success": reward > 0, "opponent": self.opponent,
                     "game": self.game}
            if info.get("reason"):
                entry["reason"] = str(info["reason"])
            if not rewards:
                entry["reason"] = "the game ended without rewards"
            results[seat_name(player_id)] = entry
            # each seat's last observation says how the game ended for it, and why
            why = f" ({entry['reason']})" if entry.get("reason") else ""
            self.unread.setdefault(seat_name(player_id), []).append(
                f"[{GAME_SENDER}] Game over: {outcome}, reward {reward:g}{why}.")
        return results

    # ---- against a fixed or outside opponent (one episode: the policy's seat) -----------

    def _opponent_moves(self) -> None:
        """Let the other seat move until it is the policy's turn or the game is over."""
        if self.opponent_option in OUTSIDE_PLAYERS and self.player is None:
            raise RuntimeError(f"textarena-2p opponent '{self.opponent_option}' has no player: "
                               "the trainer hands one over (set_opponent); evaluate against "
                               "random")
        other = 1 - self.mine
        for _ in range(MAX_OPPONENT_MOVES):
            if self.done or self.env.state.current_player_id != other:
                return
            view = "\n".join(self.transcript.get(seat_name(other), [])).strip()
            self.unread.pop(seat_name(other), None)
            self._play(self.player.act(self.system_prompt, view))
        raise RuntimeError(f"{self.game}: the opponent moved {MAX_OPPONENT_MOVES} times in a "
                           "row without handing the turn back")

    async def reset(self, seed: int) -> str:
        await asyncio.to_thread(self._start, seed)
        if self.seats:  # the turn loop reads the first mover's prompt with observe(): peek
            return "\n".join(self.unread.get(self.seat_to_move, [])).strip()
        self.mine = int(self.seat_option) if self.seat_option != "both" else seed % 2
        if self.opponent_option == "random":
            self.player = RandomMover(seed)
        await asyncio.to_thread(self._opponent_moves)
        return self._take_unread(seat_name(self.mine))

    async def step(self, action: str) -> StepResult:
        if self.seats:
            return await asyncio.to_thread(self._seat_step, action)
        if not self.done:  # the opponent may have ended the game before the policy moved
            await asyncio.to_thread(self._play, action)
            await asyncio.to_thread(self._opponent_moves)
        seat = seat_name(self.mine)
        if not self.done:
            return StepResult(self._take_unread(seat), 0.0, False,
                              {"role": seat, "opponent": self.opponent, "success": False})
        info = self._results()[seat]
        return StepResult(self._take_unread(seat), info.pop("reward"), True, info)

    # ---- self-play: the policy in both seats (``opponent: self``) -----------------------

    @property
    def seat_to_move(self) -> str:
        return seat_name(int(self.env.state.current_player_id))

    def observe(self, seat: str) -> str:
        """What ``seat`` has been told since it last looked: the game's messages to it and
        the other player's moves, as TextArena words them."""
        return self._take_unread(seat)

    def _seat_step(self, action: str) -> StepResult:
        if not self._play(action):
            return StepResult("", 0.0, False, {})
        results = self._results()
        for entry in results.values():
            entry["opponent"] = "self"
        mover = next(iter(results))
        return StepResult("", results[mover]["reward"], True, {"seats": results})


@register_env("textarena-selfplay")
def textarena_selfplay(game: str = "TicTacToe-v0", opponent: str = "self",
                       **options: Any) -> TextArenaTwoPlayer:
    """Multi-turn: self-play on a two-player TextArena game (game=TicTacToe-v0, ...).

    The policy plays player0 and player1, one episode per seat, TextArena's own rewards.
    Evaluated against the random player. Any ``textarena-2p`` option (opponent, seat,
    zero_sum) and the game's own options pass through. docs/selfplay.md."""
    return TextArenaTwoPlayer(game=game, opponent=opponent, **options)
