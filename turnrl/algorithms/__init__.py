"""Advantage estimators and policy-gradient loss pieces (pure tensor functions)."""

from turnrl.algorithms.advantages import (
    ADVANTAGE_FNS,
    dr_grpo_advantages,
    group_mean,
    group_std,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from turnrl.algorithms.estimators import AdvantageEstimator, EstimatorSettings, make_estimator
from turnrl.algorithms.losses import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    clipped_policy_loss,
    entropy_from_logits,
    kl_penalty,
    token_logprobs,
)

__all__ = [
    "ADVANTAGE_FNS",
    "AdvantageEstimator",
    "EstimatorSettings",
    "LOSS_AGGREGATIONS",
    "aggregate_loss",
    "clipped_policy_loss",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "group_mean",
    "group_std",
    "grpo_advantages",
    "kl_penalty",
    "make_estimator",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "token_logprobs",
]
