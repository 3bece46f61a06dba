"""The seats of a multi-seat game (self-play): ``Seats``, the collaborator the turn loop
(loop.py) holds and calls for every game, and the checks of a finished game's results.

In the loop (an env with ``seats``, envs/contract.py; docs/selfplay.md) one game is one env
with one episode per seat, each seat a slot of its own sharing the game's env and thread.
Only the seat to move waits for the policy; the others wait for their turn (``WAIT``: no env
call in flight, so a lock-step batch never waits on them). A seat's turn stays open until it
is that seat's turn again (its reply, then the other seats' moves as its observation: closed
by the loop's own turn rule, turns.py) or the game ends (its own reward from
``info["seats"]``, checked: e.g. a zero-sum game's rewards must sum to zero, since a broken
game that pays both seats the same would otherwise train silently); a seat that fails, runs
out of turns or of context ends the whole game, each seat with that reason.

The loop calls ``start`` for a new game's slots, ``after_call`` when a game's reset or step
has finished and ``ended`` when a seat's episode leaves the pool; ``per_game`` sizes its
groups and ``record_versions`` is set by async workers.
"""

from __future__ import annotations

import itertools
from typing import Any

from turnrl.envs import contract
from turnrl.envs.base import Env, StepResult
from turnrl.rollout.env_calls import EnvError, EnvRunner, fail_episode, raised, record_turn
from turnrl.rollout.slots import RESET as _RESET
from turnrl.rollout.slots import WAIT as _WAIT
from turnrl.rollout.slots import Game as _Game
from turnrl.rollout.slots import Slot as _Slot
from turnrl.rollout.turns import TurnRule
from turnrl.safe_json import USER_ERRORS, json_safe, safe_repr
from turnrl.types import ENV_VERSION, Episode, finite_real

ZERO_SUM_TOLERANCE = 1e-6


def seat_results(info: dict, seats: tuple[str, ...]) -> dict[str, dict]:
    """``info["seats"]`` of the step that ended a game, checked: every seat present with a
    finite number as its ``reward``. Returns seat -> a copy of its dict; ``EnvError`` (one line
    naming what is wrong) otherwise."""
    given = info.get("seats")
    if not isinstance(given, dict):
        raise EnvError("a step that ends a multi-seat game must give info['seats']: seat -> "
                       "{'reward': number, ...}")
    results = {}
    for seat in seats:
        entry = given.get(seat)
        reward = entry.get("reward") if isinstance(entry, dict) else None
        if not finite_real(reward):
            raise EnvError(f"info['seats'][{seat!r}] must be a dict with a finite 'reward', "
                           f"got {_preview(entry)}")
        results[seat] = dict(entry)
    return results


def zero_sum_violation(rewards: dict[str, float]) -> str | None:
    """Why the seats' rewards of one zero-sum game are wrong (they do not sum to zero; the
    worst case, every seat paid the same nonzero reward, is named as such), else None."""
    total = sum(rewards.values())
    if abs(total) <= ZERO_SUM_TOLERANCE:
        return None
    values = set(rewards.values())
    same = len(values) == 1 and next(iter(values)) != 0
    what = "every seat got the same reward" if same else "the rewards do not sum to zero"
    shown = ", ".join(f"{seat} {reward:g}" for seat, reward in rewards.items())
    return f"zero-sum game, but {what} ({shown}; sum {total:g})"


def record_play_order(game: _Game) -> None:
    """Each seat's episode gets the game's ``play_order`` (who moved, move by move), so a
    reader can interleave the seats' turns into the game as it was played."""
    for slot in game.seats.values():
        slot.episode.info["play_order"] = list(game.order)


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def oldest_policy_version(episode: Episode) -> int:
    """The oldest weights version that sampled one of ``episode``'s tokens (-1: none, a seat
    that never moved): the version its staleness counts."""
    return min((v for v in episode.versions if v != ENV_VERSION), default=ENV_VERSION)


class Seats:
    """The turn loop's multi-seat games (self-play), a collaborator it holds and calls: a
    game's seats take turns over one env, each seat's episode seeing the others' moves as
    environment text; each turn is opened and closed by the loop's own ``TurnRule``."""

    def __init__(self, turns: TurnRule) -> None:
        self.turns = turns
        self.per_game = 1
        """Episodes one game gives (its seats; 1 until a multi-seat game is started): a
        group's slots, for the pool's room."""
        self.record_versions = False
        """Record in each seat's episode which weights played every seat of its game
        (``info["seat_versions"]``: async workers, whose weights change mid-game)."""
        self._numbers = itertools.count()  # a game's ``game_id``

    def start(self, env: Env, seats: tuple[str, ...], runner: EnvRunner, *, assignment: int,
              seed: int, group: int) -> list[_Slot]:
        """The slots of one new game of ``env``, one per seat, sharing the env and its
        ``runner``; the caller launches the game's reset on the first."""
        game = _Game(env, number=next(self._numbers))
        for seat in seats:
            episode = Episode(env=self.turns.env_name, seed=seed, group=group,
                              info={"role": seat, "opponent": "self", "game_id": game.number})
            game.seats[seat] = _Slot(episode, assignment, env, runner, game=game, seat=seat)
        self.per_game = len(seats)
        return list(game.seats.values())

    def ended(self, slot: _Slot) -> None:
        """``slot``'s game has ended for it: with ``record_versions``, its episode records
        every seat's oldest policy version (its own and the seats it played against)."""
        if self.record_versions:
            slot.episode.info["seat_versions"] = {
                seat: oldest_policy_version(other.episode)
                for seat, other in slot.game.seats.items()}

    def after_call(self, slot: _Slot, error: BaseException | None, result) -> None:
        """A game's reset, or its mover's step, has finished: on to the next seat's turn, or
        the end of the game for every seat."""
        game = slot.game
        where = "reset" if slot.phase == _RESET else "step"
        if where == "step":  # the mover's turn is recorded whatever the step gave
            game.order.append(slot.seat)
        if error is not None:
            return self._end_game(game, error=error, where=where)
        if where == "step":
            slot.phase = _WAIT
            if result.done:  # the rewards are info["seats"]'s; result.reward is not added
                return self._finish_game(game, result)
            slot.pending_reward += float(result.reward)
        try:
            mover = self._seat_to_move(game)
            observation = self._observe(game, mover)
        except EnvError as err:
            return self._end_game(game, error=err, where=where)
        for other in game.seats.values():
            if other.phase == _RESET:
                other.phase = _WAIT
        self._seat_moves(game.seats[mover], observation)

    def _seat_to_move(self, game: _Game) -> str:
        try:
            mover = game.env.seat_to_move
        except USER_ERRORS as err:  # env code: its failure ends the game
            raise EnvError(f"env seat_to_move raised {raised(err)}") from None
        if not (isinstance(mover, str) and mover in game.seats):  # a dict is not hashable
            raise EnvError(f"env seat_to_move is {safe_repr(mover)}, not one of its seats "
                           f"{tuple(game.seats)}")
        return mover

    def _observe(self, game: _Game, seat: str) -> str:
        try:
            text = game.env.observe(seat)
        except USER_ERRORS as err:  # env code: its failure ends the game
            raise EnvError(f"env observe({seat!r}) raised {raised(err)}") from None
        if not isinstance(text, str):
            raise EnvError(f"env observe({seat!r}) returned {type(text).__name__}, not str")
        return text

    def _seat_moves(self, slot: _Slot, observation: str) -> None:
        """It is ``slot``'s turn: close its open turn with what it has seen since (or start
        its conversation), and let it wait for the policy; a seat that cannot go on (turn
        limit, context) ends the game."""
        episode = slot.episode
        if slot.turn is None and not episode.token_ids:
            self.turns.after_reset(slot, None, observation)
        else:
            try:  # the state this seat now moves in: the env's state_key when it names one
                state = contract.start_state(slot.env, observation)
            except USER_ERRORS as err:  # env code: its failure ends the game
                error = EnvError(f"env state_key raised {raised(err)}")
                return self._end_game(slot.game, error=error, where="step")
            # its turn closes as a step's would, the others' moves its observation
            result = StepResult(observation, slot.pending_reward, False, {"state_key": state})
            slot.pending_reward = 0.0
            self.turns.after_step(slot, None, result)
        if episode.status != "running":
            self._end_game(slot.game, ended=episode)

    def _finish_game(self, game: _Game, result: StepResult) -> None:
        """The game is over: each seat's open turn closed with its own reward and end text."""
        try:
            results = seat_results(result.info or {}, tuple(game.seats))
            endings = {seat: self._observe(game, seat) for seat in game.seats}
        except EnvError as err:
            return self._end_game(game, error=err, where="step")
        flag = (zero_sum_violation({seat: float(r["reward"]) for seat, r in results.items()})
                if contract.is_zero_sum(game.env) else None)
        for seat, slot in game.seats.items():
            info = results[seat]
            reward = float(info.pop("reward")) + slot.pending_reward
            if flag:
                info["zero_sum_violation"] = flag
            final = StepResult(endings[seat], reward, True, info)
            if slot.turn is not None:
                completion, text, start, end = slot.turn
                rewarded = record_turn(slot.episode, final, start, end, text,
                                       completion.finish_reason, slot.state)
            else:  # the game ended before this seat moved: its reward without a turn
                rewarded = slot.episode.add_reward(reward)
                slot.episode.success = bool(info.pop("success", False))
                slot.episode.info.update(json_safe(info))
            slot.turn = None
            if rewarded:  # else the reward failed this seat's episode (Episode.add_reward)
                slot.episode.end("done", "done")
        record_play_order(game)

    def _end_game(self, game: _Game, *, error: BaseException | None = None, where: str = "",
                  ended: Episode | None = None) -> None:
        """End every running seat of ``game``: with ``error`` (an env call failed), or as
        ``ended`` ended (a seat ran out of turns or context). Open turns are kept, unrewarded."""
        for slot in game.seats.values():
            episode = slot.episode
            if episode.status != "running":
                continue
            if slot.turn is not None:
                completion, text, start, end = slot.turn
                rewarded = record_turn(episode, StepResult("", slot.pending_reward, False, {}),
                                       start, end, text, completion.finish_reason, slot.state)
                slot.turn = None
                if not rewarded:  # its reason (the reward) stands
                    continue
            if error is not None:
                fail_episode(episode, error, where)
            else:
                seat = next(s for s, other in game.seats.items() if other.episode is ended)
                episode.end(ended.status, ended.end_reason,
                            f"seat {seat} ended the game: {ended.info.get('reason', '')}")
        record_play_order(game)
