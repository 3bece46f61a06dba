"""Adapters to environment libraries people already use (each needs `pip install turnrl[envs]`)."""

from turnrl.envs.adapters import gymnasium_env as _gymnasium_env  # noqa: F401
from turnrl.envs.adapters import openenv_env as _openenv_env  # noqa: F401
from turnrl.envs.adapters import reasoning_gym_env as _reasoning_gym_env  # noqa: F401
from turnrl.envs.adapters import textarena_env as _textarena_env  # noqa: F401
from turnrl.envs.adapters import verifiers_env as _verifiers_env  # noqa: F401
