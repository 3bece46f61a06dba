"""Gymnasium toy-text tasks (FrozenLake, Taxi, CliffWalking, Blackjack) as multi-turn text games.

The observation is the env's ANSI rendering made plain text for a language model: the
highlighted cell (where the agent is) becomes ``@``, colour codes are dropped, Taxi adds where
the passenger waits and where it goes (their colours told that), Blackjack is a sentence. The
reply must name one legal action, listed in the system prompt with the legend. An unreadable reply is a wasted turn whose
observation says what is legal. ``state_key`` is the discrete gymnasium observation, the anchor
state GiGPO groups on.

FrozenLake's further options (a new map per seed, chained moves, RAGEN's text, ``protocol
ragen``) are frozen_lake.py's; without them the game is gymnasium's, as before.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from turnrl.envs.adapters.frozen_lake import (
    LakeSettings,
    chained_actions,
    lake_prompt,
    lake_settings,
    ragen_text,
    random_lake,
)
from turnrl.envs.base import StepResult, register_env

ACTIONS = {
    "FrozenLake-v1": ["left", "down", "right", "up"],
    "CliffWalking-v1": ["up", "right", "down", "left"],
    "Taxi-v4": ["south", "north", "east", "west", "pickup", "dropoff"],
    "Blackjack-v1": ["stick", "hit"],
}
"""Game -> action names, in gymnasium's action-index order."""


LEGENDS = {
    "FrozenLake-v1": "@ is you, F frozen, H a hole, G the goal.",
    "CliffWalking-v1": "x is you, C the cliff, T the target.",
    "Taxi-v4": "@ is the taxi; R, G, Y, B are the stops.",
    "Blackjack-v1": "",
}
_HIGHLIGHT = re.compile(r"\x1b\[4[0-7](?:;1)?m(.)\x1b\[0m")  # a background-coloured cell
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def plain_text(ansi: str) -> str:
    """An ANSI rendering as plain text: the highlighted cell becomes ``@``, colours go."""
    return _COLOUR.sub("", _HIGHLIGHT.sub("@", ansi)).rstrip()


def parse_action(text: str, names: list[str]) -> int | None:
    """Index of the last legal action name in ``text``, else None."""
    words = re.findall(r"[a-z]+", text.lower())
    found = [w for w in words if w in names]
    return names.index(found[-1]) if found else None


def likeliest(outcomes: list[tuple]) -> tuple:
    """The most probable (probability, next state, reward, terminated) of a transition."""
    return max(outcomes, key=lambda o: o[0])


def shortest_plan(transitions: dict, start: int) -> list[int] | None:
    """Actions of a shortest path from ``start`` to a rewarded termination, following each
    action's likeliest outcome (exact for deterministic games: FrozenLake non-slippery,
    Taxi), by breadth-first search over gymnasium's transition table ``P[s][a]``; None when
    no rewarded end is reachable."""
    previous: dict[int, tuple[int, int] | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for state in frontier:
            for action, outcomes in transitions[state].items():
                _, nxt, reward, terminated = likeliest(outcomes)
                if terminated and reward > 0:
                    plan = [action]
                    while previous[state] is not None:
                        state, step = previous[state]
                        plan.append(step)
                    return plan[::-1]
                if not terminated and nxt not in previous:
                    previous[nxt] = (state, action)
                    following.append(nxt)
        frontier = following
    return None


def require_gymnasium() -> Any:
    try:
        import gymnasium
    except ImportError:
        raise ImportError("gymnasium is not installed; run: pip install 'turnrl[envs]' "
                          "(or pip install gymnasium)") from None
    return gymnasium


def goal_values(transitions: dict, is_goal, gamma: float = 0.98, sweeps: int = 400
                ) -> dict[int, float]:
    """Value iteration on a toy-text transition table (``P[state][action] = [(probability,
    next, reward, done), ...]``): a goal transition pays 1, every other end 0, discounted by
    ``gamma`` a step, so the greedy action takes the shortest path on deterministic games and
    the likeliest one on slippery ice."""
    values = dict.fromkeys(transitions, 0.0)
    for _ in range(sweeps):
        changed = 0.0
        for state, actions in transitions.items():
            best = max(action_value(outcomes, values, is_goal, gamma)
                       for outcomes in actions.values())
            changed, values[state] = max(changed, abs(best - values[state])), best
        if changed < 1e-9:
            break
    return values


def action_value(outcomes: list, values: dict[int, float], is_goal, gamma: float) -> float:
    return sum(p * (1.0 if is_goal(reward, done) else 0.0 if done else gamma * values[int(nxt)])
               for p, nxt, reward, done in outcomes)


_VALUES: dict[str, dict[int, float]] = {}
"""Value tables per game and options: the transition table of a game never changes."""


class PlannerPlayer:
    """A reference player (envs/reference.py) for the toy-text games: the greedy action of
    value iteration on the env's own transition table (``goal_values``: the shortest path on
    FrozenLake, Taxi and CliffWalking, the likeliest on slippery ice), and for Blackjack
    hit below 17. Where a turn may chain moves (FrozenLake's ``actions_per_turn``), it
    spreads the moves left evenly over the turns left (RAGEN's 10 over 5: two a turn),
    planning each next move from the best outcome of the one before: on slippery ice that
    is a guess, and the next turn's observation corrects it."""

    def __init__(self, env: GymnasiumText) -> None:
        self.env = env

    def reset(self, first_observation: str) -> None:
        pass

    def act(self, observation: str) -> str:
        env = self.env
        if env.game == "Blackjack-v1":
            return "hit" if env.obs[0] < 17 else "stick"
        values, is_goal = self._values()
        transitions, state, moves = env.env.unwrapped.P, int(env.obs), []
        for _ in range(self._moves_this_turn()):
            actions = transitions[state]
            best = max(actions, key=lambda a: action_value(actions[a], values, is_goal, 0.98))
            moves.append(env.names[best])
            _, state, _, done = max(actions[best], key=lambda o: (o[0], values[int(o[1])]))
            if done:
                break
        return " || ".join(moves)

    def _values(self) -> tuple[dict[int, float], Any]:
        env, cliff = self.env, self.env.game == "CliffWalking-v1"

        def is_goal(reward: float, done: bool) -> bool:
            return bool(done) and (cliff or reward > 0)

        key = f"{env.game}:{env.make_options}:{env.lake_map}"  # a drawn map: its own table
        if key not in _VALUES:
            _VALUES[key] = goal_values(env.env.unwrapped.P, is_goal)
        return _VALUES[key], is_goal

    def _moves_this_turn(self) -> int:
        lake, env = self.env.lake, self.env
        if lake.actions_per_turn == 1:
            return 1
        turns_left = max(env.max_turns - env.turn, 1)
        moves_left = (lake.max_actions - env.moves if lake.max_actions  # no cap: K a turn
                      else lake.actions_per_turn * turns_left)
        return max(1, min(lake.actions_per_turn, -(-moves_left // turns_left)))


@register_env("gymnasium")
class GymnasiumText:
    """Multi-turn: a gymnasium toy-text game (game=FrozenLake-v1|Taxi-v4|CliffWalking-v1|Blackjack-v1);
    FrozenLake also takes size, frozen, ends, actions_per_turn, max_actions, render and
    protocol (ragen) (frozen_lake.py)."""

    def __init__(self, game: str = "FrozenLake-v1", max_turns: int | None = None,
                 protocol: str = "", **make_options: Any):
        if game not in ACTIONS:
            raise ValueError(f"unknown gymnasium game '{game}'; choose one of: {', '.join(ACTIONS)}")
        if protocol and game != "FrozenLake-v1":
            raise ValueError("gymnasium: 'protocol' is a FrozenLake-v1 option")
        require_gymnasium()  # the one-line install hint before anything else
        self.lake = LakeSettings(max_turns=30 if max_turns is None else max_turns)
        if game == "FrozenLake-v1":
            self.lake, make_options = lake_settings(protocol, max_turns, make_options)
        self.game, self.names, self.max_turns = game, ACTIONS[game], self.lake.max_turns
        self.make_options, self.lake_map = make_options, ""
        """``lake_map``: the drawn map of this episode (``size``), '' on a fixed map."""
        self.render_mode = {} if game == "Blackjack-v1" else {"render_mode": "ansi"}
        self.env = self._make(0)
        self.system_prompt = (f"You are playing {game.split('-')[0]}. {LEGENDS[game]} Reply with "
                              f"one action: {'/'.join(self.names)}.").replace(".  ", ". ")
        if not self.lake.plain:
            self.system_prompt = lake_prompt(self.lake, make_options.get("is_slippery", True))
        self.obs: Any = None
        self.turn = self.moves = 0

    def _make(self, seed: int) -> Any:
        """The gymnasium env; with ``size``, on the map drawn from ``seed``."""
        drawn = {}
        if self.lake.size:
            rows = random_lake(self.lake.size, self.lake.frozen, seed, self.lake.ends)
            drawn, self.lake_map = {"desc": rows}, "/".join(rows)
        gym = require_gymnasium()
        return gym.make(self.game, **self.render_mode, **self.make_options, **drawn)

    @property
    def state_key(self) -> str:
        return str(self.obs)

    def describe(self) -> str:
        if self.game == "Blackjack-v1":
            total, dealer, ace = self.obs
            return (f"Your hand totals {total}{' with a usable ace' if ace else ''}; "
                    f"the dealer shows {dealer}. Hit or stick?")
        if self.lake.render == "ragen":
            return ragen_text(self.env.unwrapped.desc.tolist(), int(self.obs))
        text = plain_text(str(self.env.render())).lstrip("\n")
        if self.game == "Taxi-v4":
            _, _, passenger, destination = self.env.unwrapped.decode(self.obs)
            where = "in the taxi" if passenger == 4 else f"at {'RGYB'[passenger]}"
            text += f"\nThe passenger is {where} and wants to go to {'RGYB'[destination]}."
        return text

    def reference_player(self) -> PlannerPlayer:
        return PlannerPlayer(self)

    async def reset(self, seed: int) -> str:
        if self.lake.size:  # a new map for every seed
            self.env = self._make(seed)
        self.obs, _ = await asyncio.to_thread(self.env.reset, seed=seed)
        self.turn = self.moves = 0
        return self.describe()

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        lake = self.lake
        indices = ([i] if (i := parse_action(action, self.names)) is not None else []) \
            if lake.plain else chained_actions(action, self.names, lake.actions_per_turn)
        out_of_turns = self.turn >= self.max_turns
        if not indices:
            return StepResult(f"Reply with one of: {', '.join(self.names)}.", 0.0, out_of_turns,
                              {"success": False, "state_key": self.state_key})
        reward = 0.0
        for index in indices:  # one move, or a chain played until the episode ends
            self.obs, gained, terminated, truncated, _ = await asyncio.to_thread(
                self.env.step, index)
            reward, self.moves = reward + gained, self.moves + 1
            out_of_moves = bool(lake.max_actions) and self.moves >= lake.max_actions
            if terminated or truncated or out_of_moves:
                break
        done = bool(terminated or truncated) or out_of_turns or out_of_moves
        # CliffWalking pays -1 a step, the last one too: reaching the target is its success
        reached = reward > 0 or self.game == "CliffWalking-v1"
        info = {"success": bool(terminated) and reached, "state_key": self.state_key}
        return StepResult(self.describe(), float(reward), done, info)
