"""The learner: one RL step, the one learner loop over a rollout source, run set-up."""

from turnrl.trainer.bookkeeping import TrainResult
from turnrl.trainer.learn import RolloutSource, SourceDefaults, learn
from turnrl.trainer.local import LocalSource, train
from turnrl.trainer.rl_step import rl_step
from turnrl.trainer.step import UpdateSettings, policy_update

__all__ = ["LocalSource", "RolloutSource", "SourceDefaults", "TrainResult", "UpdateSettings",
           "learn", "policy_update", "rl_step", "train"]
