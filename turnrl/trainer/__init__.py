"""Trainers: one shared update step and the synchronous loop."""

from turnrl.trainer.step import UpdateSettings, policy_update
from turnrl.trainer.sync import TrainResult, train

__all__ = ["TrainResult", "UpdateSettings", "policy_update", "train"]
