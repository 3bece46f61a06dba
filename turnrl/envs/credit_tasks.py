"""Tasks built to need turn-level credit: one decisive turn among many that do not matter.

``key-corridor``: at turn 0 the agent picks one of ``keys`` keys, then walks a corridor of
filler turns where any reply is fine, and at the last turn the door opens only with the right
key. The episode has ``horizon`` policy turns; only the last pays (1 on success, else 0).
Outcome-level credit (GRPO) gives the key turn and every filler turn the same advantage, so
as the horizon grows the one informative turn drowns in ``horizon - 1`` turns of noise; a
turn-level method can score the key turn alone. The observations name what the agent holds,
so the state is Markov and recurs across a group's episodes (GiGPO's anchor states), and the
turn-level values of any key-choosing policy are known in closed form
(``key_corridor_values``).

Action space (kept tiny so the 154k-parameter model can learn it from scratch): a reply picks
the key ``ord(first character) % keys`` (an empty reply picks key 0). Digits name keys directly
("0" is key 0, "1" key 1, for ``keys`` dividing 48: 2, 3, 4, 6, 8, ...), and every reply picks
some key, so a random policy already succeeds about ``1 / keys`` of the time. The right key
is the same for every seed by default (``vary_key: false``), so the task is pure credit
assignment; with ``vary_key: true`` it is drawn per seed and shown in the first observation,
so the policy must also read it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from turnrl.envs.base import StepResult, register_env


def chosen_key(action: str, keys: int) -> int:
    """The key a reply picks: its first character's code mod ``keys`` (0 for an empty reply)."""
    return ord(action[0]) % keys if action else 0


@dataclass(frozen=True)
class CorridorValues:
    """True turn-level values of a key-corridor episode under a policy that picks the right
    key with probability ``p_right`` (whatever it does in the corridor does not matter).

    ``v_start``: ``V(s_0)``. ``q_start``: ``Q(s_0, right key)``, ``Q(s_0, wrong key)``.
    ``v_right[t]`` / ``v_wrong[t]``: ``V(s_t)`` for ``t = 1 .. horizon - 1`` holding the right
    or a wrong key (index 0 is unused, equal to ``q_start``'s entries, the state after turn 0).
    """

    v_start: float
    q_start: tuple[float, float]
    v_right: tuple[float, ...]
    v_wrong: tuple[float, ...]

    def value(self, turn: int, right: bool | None) -> float:
        """``V(s_turn)``; ``right`` is None at turn 0 (no key held yet)."""
        if turn == 0:
            return self.v_start
        return (self.v_right if right else self.v_wrong)[turn]


def key_corridor_values(horizon: int, p_right: float, gamma: float) -> CorridorValues:
    """Closed-form ``V^pi`` and ``Q^pi`` for ``key-corridor`` (reward 1 at the last turn on
    success, discount ``gamma`` per turn): holding the right key at turn ``t`` the return is
    ``gamma^(horizon - 1 - t)``, holding a wrong one it is 0, and at the start it is
    ``p_right * gamma^(horizon - 1)``."""
    if horizon < 2:
        raise ValueError(f"horizon must be at least 2 (a key turn and the door), got {horizon}")
    right = tuple(gamma ** (horizon - 1 - t) for t in range(horizon))
    wrong = tuple(0.0 for _ in range(horizon))
    return CorridorValues(p_right * right[0], (right[0], 0.0), right, wrong)


@register_env("key-corridor")
class KeyCorridor:
    """Pick a key, walk ``horizon - 2`` filler turns, open the door: reward 1 iff the key fits.

    ``info["state_key"]`` is ``start`` before the key turn, then ``t<turn>:k<key>``; the key
    held is also in every observation, so states are Markov and recur within a group.
    """

    cooperative = True  # pure Python, never blocks: shares one env thread

    system_prompt = "Reply with one character."

    def __init__(self, horizon: int = 8, keys: int = 2, right_key: int = 1,
                 vary_key: bool = False):
        if horizon < 2:
            raise ValueError(f"horizon must be at least 2 (a key turn and the door), "
                             f"got {horizon}")
        if keys < 2:
            raise ValueError(f"keys must be at least 2 (one right, one wrong), got {keys}")
        if not 0 <= right_key < keys:
            raise ValueError(f"right_key must be in 0..{keys - 1}, got {right_key}")
        self.horizon, self.keys, self.default_key, self.vary_key = (horizon, keys, right_key,
                                                                    vary_key)
        self.right_key, self.held, self.turn = right_key, -1, 0

    @property
    def state_key(self) -> str:
        return "start" if self.held < 0 else f"t{self.turn}:k{self.held}"

    async def reset(self, seed: int) -> str:
        self.right_key = (random.Random(seed).randrange(self.keys) if self.vary_key
                          else self.default_key)
        self.held, self.turn = -1, 0
        hint = f" The door takes key {self.right_key}." if self.vary_key else ""
        return f"Pick a key, 0-{self.keys - 1}.{hint}"

    async def step(self, action: str) -> StepResult:
        if self.held < 0:
            self.held = chosen_key(action, self.keys)
        self.turn += 1
        info = {"state_key": self.state_key, "turns": self.turn}
        if self.turn >= self.horizon:
            success = self.held == self.right_key
            info["success"] = success
            return StepResult("Open." if success else "Locked.", float(success), True, info)
        where = "door" if self.turn == self.horizon - 1 else f"step {self.turn}"
        return StepResult(f"{where}, key {self.held}", 0.0, False, info)
