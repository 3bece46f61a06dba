"""Environments: the ``Env`` protocol, the registry and the built-in tasks."""

from turnrl.envs import builtin as _builtin  # noqa: F401  (registers the built-in tasks)
from turnrl.envs.base import ENVS, Env, StepResult, make_env, register_env

__all__ = ["ENVS", "Env", "StepResult", "make_env", "register_env"]
