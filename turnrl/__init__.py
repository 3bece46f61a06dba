"""TurnRL: reinforcement learning for multi-turn language-model agents."""

from turnrl import algorithms  # noqa: F401 - registers the built-in advantage estimators
from turnrl.config import Config, load_config
from turnrl.envs import Env, StepResult, make_env, register_env
from turnrl.types import Batch, Episode, Turn

__version__ = "0.1.0"

__all__ = ["Batch", "Config", "Env", "Episode", "StepResult", "Turn", "load_config", "make_env",
           "register_env"]
