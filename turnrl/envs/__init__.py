"""Environments: the ``Env`` protocol, the registry and the built-in tasks."""

# imported for their @register_env side effect
from turnrl.envs import adapters as _adapters  # noqa: F401
from turnrl.envs import builtin as _builtin  # noqa: F401
from turnrl.envs import credit_tasks as _credit_tasks  # noqa: F401
from turnrl.envs import dataset as _dataset  # noqa: F401
from turnrl.envs import kuhn as _kuhn  # noqa: F401
from turnrl.envs import latency as _latency  # noqa: F401
from turnrl.envs import maze as _maze  # noqa: F401
from turnrl.envs import mcp_env as _mcp_env  # noqa: F401
from turnrl.envs import search as _search  # noqa: F401
from turnrl.envs import simulated_user as _simulated_user  # noqa: F401
from turnrl.envs import sokoban as _sokoban  # noqa: F401
from turnrl.envs import tictactoe as _tictactoe  # noqa: F401
from turnrl.envs import tool_env as _tool_env  # noqa: F401
from turnrl.envs import twenty_questions as _twenty_questions  # noqa: F401
from turnrl.envs import wordle as _wordle  # noqa: F401
from turnrl.envs import wrappers as _wrappers  # noqa: F401
from turnrl.envs.base import ENVS, Env, StepResult, make_env, register_env

__all__ = ["ENVS", "Env", "StepResult", "make_env", "register_env"]
