"""The ``critic`` config section: every setting of turn-level credit assignment (discounting,
the turn-level critic, its warm-up and scale, GiGPO's weights), docs/credit_assignment.md.

An estimator declares which of these it reads (``turnrl.registry.ESTIMATORS``; ``--help
critic`` lists the readers of each); setting one that the chosen ``algo.advantage`` does not
read is refused (``turnrl/config/checks.py``).
Every default leaves the estimators as the papers have them. The maths lives in
``turnrl/algorithms/estimators.py`` and ``turnrl/algorithms/credit.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from turnrl.config.types import Section


@dataclass(frozen=True)
class CriticConfig(Section):
    gamma: float = 0.95
    """discount per turn"""
    gae_lambda: float = 0.95
    """GAE lambda over turns"""
    token_lambda: float = 1.0
    """token_gae: GAE lambda per policy token (1 = Monte-Carlo returns minus V, as
    Open-Reasoner-Zero; PPO's usual 0.95 leans on V within a few dozen tokens)"""
    value_clip: float = 0.5
    """token_gae: PPO value clipping, each critic step's loss is max((V - R)^2,
    (V_old + clip(V - V_old, +-value_clip) - R)^2) around the values the advantages used
    (0 = off; verl's default 0.5)"""
    lr: float = 1e-3
    """learning rate of the turn-level critic"""
    tau: float = 0.1
    """Polyak rate of the critic's target networks"""
    updates: int = 8
    """critic gradient steps per training step"""
    replay_episodes: int = 256
    """replay buffer size, in episodes"""
    warmup_updates: int = 0
    """critic gradient steps taken before the policy uses the critic's advantages; until then
    the policy gets the outcome GRPO advantage while the critic trains (0 = use the critic
    from the first step)"""
    warmup_max_error: float = 0.0
    """also use GRPO's advantage while the critic's fit error on the batch (mean squared error
    of V against the turns' discounted returns, over their variance, before the critic sees
    the batch) is above this (0 = no error test)"""
    scale: Literal["batch", "running", "none"] = "batch"
    """batch = whiten the critic's advantages over the batch's policy tokens (PPO's usual);
    running = divide by a running RMS of the turn advantages (no centring); none = raw
    advantages"""
    features: Literal["policy", "frozen"] = "policy"
    """what the critic reads: the live policy's hidden states (they drift as the policy
    trains), or those of a frozen copy of the starting policy (fixed inputs, at the memory of
    one more model; saved with checkpoints)"""
    gigpo_step_weight: float = 1.0
    """GiGPO: weight of the step-level (anchor-state) advantage added to the episode-level
    one"""
    gigpo_episode_weight: float = 1.0
    """GiGPO: weight of the episode-level advantage A_E (0 = step-level, anchor-state
    advantages only)"""

    def _check(self) -> None:
        self._require("gamma", 0 <= self.gamma <= 1, "in [0, 1]")
        self._require("gae_lambda", 0 <= self.gae_lambda <= 1, "in [0, 1]")
        self._require("token_lambda", 0 <= self.token_lambda <= 1, "in [0, 1]")
        self._require("lr", self.lr > 0, "> 0")
        self._at_least(0, "tau", "value_clip", "warmup_updates", "warmup_max_error",
                       "gigpo_episode_weight")
        self._at_least(1, "updates", "replay_episodes")
