"""Rollouts: the chat format and the one turn loop (the samplers it calls: turnrl.samplers)."""

from turnrl.rollout.chat import ChatFormat, TemplateError
from turnrl.rollout.loop import Group, TurnLoop, run_episodes, run_sync

__all__ = ["ChatFormat", "Group", "TemplateError", "TurnLoop", "run_episodes", "run_sync"]
