"""TurnRL: reinforcement learning for multi-turn language-model agents."""

from turnrl import algorithms  # noqa: F401 - registers the built-in advantage estimators
from turnrl.config import Config, load_config
from turnrl.envs import Env, StepResult, make_env, register_env
from turnrl.types import Batch, Episode, Turn

__version__ = "0.4.0.dev0"  # the one version number; CHANGELOG.md's top entry names it

__all__ = ["Batch", "Config", "Env", "Episode", "StepResult", "Turn", "__version__", "load_config",
           "make_env", "register_env"]
