"""Trainers: the one RL step, the sync loop, the async learner loop, shared run set-up."""

from turnrl.trainer.rl_step import rl_step
from turnrl.trainer.run import TrainResult
from turnrl.trainer.step import UpdateSettings, policy_update
from turnrl.trainer.sync import train

__all__ = ["TrainResult", "UpdateSettings", "policy_update", "rl_step", "train"]
