"""TextArena single-player games (GuessTheNumber-v0, Wordle-v0, TowerOfHanoi-v0, ...), one move a turn.

Runs offline: only single-player games, so no opponent model is called. The first observation
is TextArena's own prompt; later ones are what the game appended after the move. The reward is
TextArena's reward for player 0 at the end; success when it is positive.
"""

from __future__ import annotations

import asyncio
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
