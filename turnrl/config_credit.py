"""The ``credit`` config section: how the turn-level estimators hand their advantages to the
policy (docs/credit_assignment.md, "Critic warm-up and scale").

Every default leaves the estimators as they were (critic advantages from the first step,
whitened over the batch; GiGPO's episode term at weight 1). The maths lives in
``turnrl/algorithms/estimators.py`` and ``turnrl/algorithms/credit.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from turnrl.config_types import Section


@dataclass(frozen=True)
class CreditConfig(Section):
    warmup_updates: int = 0
    """turn_gae, archer: critic gradient steps taken before the policy uses the critic's
    advantages; until then the policy gets the outcome GRPO advantage while the critic trains
    (0 = use the critic from the first step)"""
    warmup_max_error: float = 0.0
    """turn_gae, archer: also use GRPO's advantage while the critic's fit error on the batch
    (mean squared error of V against the turns' discounted returns, over their variance,
    before the critic sees the batch) is above this; 0 = no error test"""
    scale: Literal["batch", "running", "none"] = "batch"
    """turn_gae, archer: batch = whiten the critic's advantages over the batch's policy tokens
    (PPO's usual); running = divide by a running RMS of the turn advantages (no centring);
    none = raw advantages"""
    critic_features: Literal["policy", "frozen"] = "policy"
    """turn_gae, archer: what the critic reads: the live policy's hidden states (they drift as
    the policy trains), or those of a frozen copy of the starting policy (fixed inputs, at the
    memory of one more model; saved with checkpoints)"""
    gigpo_episode_weight: float = 1.0
    """gigpo: weight of the episode-level advantage A_E (0 = step-level, anchor-state
    advantages only); algo.gigpo_step_weight weighs the step-level one"""

    def _check(self) -> None:
        self._at_least(0, "warmup_updates", "warmup_max_error", "gigpo_episode_weight")
