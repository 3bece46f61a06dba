"""An OpenEnv (0.3) environment in that library's own format: guess a hidden number in a few
turns, told "higher" or "lower" (typed Action/Observation, reset/step/state).

``crash`` makes every ``step`` raise, for the adapters' failure path.
"""

import random
import re

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""


class GuessNumberEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, high: int = 8, max_turns: int = 4, crash: bool = False):
        super().__init__()
        self.high, self.max_turns, self.crash = high, max_turns, crash
        self._state = State()
        self.target = 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.target = random.Random(seed).randint(1, self.high)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt=f"Guess my number between 1 and {self.high}. "
                                "Reply with one number.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        if self.crash:
            raise RuntimeError("the environment crashed on purpose")
        self._state.step_count += 1
        numbers = re.findall(r"\d+", action.message)
        guess = int(numbers[0]) if numbers else None
        if guess == self.target:
            return GuessObservation(prompt="Correct!", done=True, reward=1.0,
                                    metadata={"turns": self._state.step_count})
        hint = "Higher." if guess is None or guess < self.target else "Lower."
        return GuessObservation(prompt=hint, done=self._state.step_count >= self.max_turns,
                                reward=0.0)

    @property
    def state(self) -> State:
        return self._state
