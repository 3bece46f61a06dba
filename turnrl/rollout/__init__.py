"""Rollouts: the engine protocol, the CPU engine, the chat format and the one turn loop."""

from turnrl.rollout.chat import ChatFormat, TemplateError
from turnrl.rollout.engine import Completion, Engine, SamplingParams, sample_tokens
from turnrl.rollout.hf_engine import HFEngine
from turnrl.rollout.loop import Group, TurnLoop, run_episodes, run_sync

__all__ = ["ChatFormat", "Completion", "Engine", "Group", "HFEngine", "SamplingParams",
           "TemplateError", "TurnLoop", "run_episodes", "run_sync", "sample_tokens"]
