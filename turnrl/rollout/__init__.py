"""Rollouts: the engine protocol, the CPU engine and the turn loop."""

from turnrl.rollout.engine import Completion, Engine, SamplingParams, sample_tokens
from turnrl.rollout.episode import ChatFormat, TemplateError, run_episodes, run_sync
from turnrl.rollout.hf_engine import HFEngine

__all__ = ["ChatFormat", "Completion", "Engine", "HFEngine", "SamplingParams", "TemplateError",
           "run_episodes", "run_sync", "sample_tokens"]
