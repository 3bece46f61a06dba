"""Off-policy pieces for asynchronous training: the decoupled PPO objective, the effective
sample size of its importance weights, an ESS-driven staleness bound, and episode staleness.

In async mode an episode's tokens were sampled by the *behaviour* policy (the rollout worker's
weights, possibly several versions old, even mixed versions within one episode under partial
rollouts). Decoupled PPO separates the two jobs the "old" policy does in PPO: the trust region
is kept around the *proximal* policy (the learner's weights right before this update, scored
with no grad), and the gap between proximal and behaviour policy is corrected by an importance
weight.

Papers:
- Decoupled PPO objective: Hilton, Cobbe & Schulman 2022, "Batch size-invariance for policy
  optimization" (arXiv:2110.00641), which introduces the proximal policy; used for
  asynchronous LLM RL by Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
  Learning System for Language Reasoning" (arXiv:2505.24298).
- Truncated importance sampling: Ionides 2008, "Truncated Importance Sampling" (J. Comput.
  Graph. Stat. 17(2)); the same per-step cap is V-trace's rho-bar in Espeholt et al. 2018,
  "IMPALA" (arXiv:1802.01561).
- Effective sample size: Kong 1992, "A note on importance sampling using standardized weights"
  (Tech. Rep. 348, U. Chicago Statistics); the ``(sum w)^2 / sum w^2`` form as in Owen 2013,
  "Monte Carlo theory, methods and examples", ch. 9.
- Bounded staleness (train only on episodes at most eta versions old): AReaL again.

Departures:
- Over-cap weights. Neither paper's objective truncates the weight; AReaL's implementation
  (its ``behav_imp_weight_cap``) *drops* tokens whose weight exceeds the cap. The default here
  is ``over_cap="truncate"``: ``w = min(w, cap)``, which keeps the token's gradient direction
  and bounds its size (a few tokens with a huge weight are usually the ones the learner has
  moved furthest towards, so silencing them entirely throws away signal). ``over_cap="drop"``
  reproduces AReaL. Dropped tokens get weight 0 but still count in the loss aggregation's
  denominator, so micro-batch totals stay the same.
- ``AdaptiveStaleness`` (an ESS-driven bound) is this project's heuristic, not from a paper:
  AReaL uses a fixed bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from turnrl.algorithms.losses import policy_loss
from turnrl.types import ENV_VERSION

if TYPE_CHECKING:
    from turnrl.config import StalenessConfig

OVER_CAP_MODES = ("truncate", "drop")


def behaviour_weights(
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    cap: float = 0.0,
    over_cap: Literal["truncate", "drop"] = "truncate",
) -> Tensor:
    """Importance weights ``w = pi_prox / pi_behav = exp(prox - behav)``, detached.

    prox_logprobs, behav_logprobs ``[B,T]`` -> ``[B,T]`` float. ``cap > 0`` bounds them:
    "truncate" gives ``min(w, cap)`` (Ionides 2008), "drop" sets ``w = 0`` where ``w > cap``
    (AReaL's filter). ``cap = 0`` leaves them raw; pass raw weights to ``normalised_ess``.
    Padding positions (both log-probs 0) get weight 1.
    """
    if over_cap not in OVER_CAP_MODES:
        raise ValueError(f"unknown over_cap {over_cap!r}; valid: {list(OVER_CAP_MODES)}")
    if cap < 0:
        raise ValueError(f"cap must be >= 0 (0 = no cap), got {cap}")
    weights = torch.exp(prox_logprobs.detach() - behav_logprobs.detach())
    if cap > 0:
        if over_cap == "truncate":
            weights = weights.clamp(max=cap)
        else:
            weights = weights.masked_fill(weights > cap, 0.0)
    return weights


def decoupled_policy_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    is_cap: float = 0.0,
    over_cap: Literal["truncate", "drop"] = "truncate",
    dual_clip: float = 0.0,
    *,
    loss: str = "ppo",
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025), with DAPO clip-higher:
    ``-w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``,
    ``r = pi_theta / pi_prox``, ``w = sg[pi_prox / pi_behav]`` bounded by ``is_cap``.

    logprobs (current policy, with grad), prox_logprobs (the learner's policy before this
    update, computed with no grad and fixed across the update's epochs), behav_logprobs (the
    sampler's) ``[B,T]``; advantages ``[B,T]`` or ``[B]`` (broadcast over tokens).
    ``is_cap`` and ``over_cap`` as in ``behaviour_weights`` (``is_cap = 0``: no cap).
    ``loss`` names the objective inside (``losses.POLICY_LOSSES``: ppo, gspo, cispo), its ratio
    taken against the proximal policy; ``mask`` ``[B,T]`` marks the policy tokens (GSPO's
    sequence ratio averages over them; None = every token).

    Returns per-token loss ``[B,T]``, bool ``[B,T]`` marking tokens where the clipped branch is
    strictly smaller (zero gradient), and the weights ``[B,T]`` actually applied (detached).
    When prox == behav every weight is exactly 1 and this is ``clipped_policy_loss``.
    """
    weights = behaviour_weights(prox_logprobs, behav_logprobs, is_cap, over_cap)
    # The proximal policy is a constant of the update: no gradient reaches it through r either.
    mask = torch.ones_like(logprobs, dtype=torch.bool) if mask is None else mask
    per_token, clipped = policy_loss(loss)(logprobs, prox_logprobs.detach(), advantages, mask,
                                           clip_low, clip_high, dual_clip)
    return weights * per_token, clipped, weights


def normalised_ess(weights: Tensor, mask: Tensor | None = None) -> float:
    """Normalised effective sample size ``(sum w)^2 / (n * sum w^2)`` of the weights under
    ``mask`` (Kong 1992; Owen 2013, ch. 9). weights ``[B,T]`` (non-negative), mask ``[B,T]``
    bool or 0/1, or None for all entries.

    1 when all weights are equal, ``1/n`` when one weight carries everything. Pass the raw
    (uncapped) behaviour weights: capping hides the mismatch the ESS is meant to measure.
    Edge cases: no selected tokens gives 1.0 (no evidence of a mismatch); infinite weights
    (``exp`` overflow) share the mass equally among themselves, giving ``#inf / n``; all-zero
    weights give 0.0. Computed in float64 after dividing by the largest weight, which leaves
    the value unchanged and avoids overflow of ``w^2``.
    """
    w = weights.detach() if mask is None else weights.detach()[mask.bool()]
    w = w.double().flatten()
    if w.numel() == 0:
        return 1.0
    if torch.isinf(w).any():
        w = torch.isinf(w).double()
    largest = w.max()
    if largest <= 0:
        return 0.0
    w = w / largest
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))


@dataclass(frozen=True)
class StalenessDecision:
    """What one ``AdaptiveStaleness.update`` did."""

    action: Literal["shrink", "grow", "hold"]
    before: int
    after: int
    ess: float
    high_streak: int

    @property
    def changed(self) -> bool:
        return self.before != self.after

    @property
    def event(self) -> str:
        """e.g. ``"shrink 3->2 (ess 0.41)"``; empty when the bound did not move."""
        if not self.changed:
            return ""
        return f"{self.action} {self.before}->{self.after} (ess {self.ess:.2f})"

    def metrics(self) -> dict[str, float]:
        return {"staleness/max_versions": float(self.after), "staleness/ess": self.ess,
                "staleness/high_streak": float(self.high_streak)}


@dataclass
class AdaptiveStaleness:
    """The staleness bound ``max_versions``, moved once per learner step by the measured ESS.

    ESS < ess_low: shrink by 1 (not below 0) and reset the streak. ESS > ess_high for
    ``patience`` consecutive steps: grow by 1 (not above ``limit``) and reset the streak.
    Otherwise hold; an ESS in [ess_low, ess_high] resets the streak, a NaN ESS (nothing
    measured) leaves everything as it was. Shrinking reacts at once and growing waits, so the
    bound backs off quickly when the data gets too off-policy and creeps up only when it has
    stayed close to on-policy for a while.
    """

    max_versions: int
    ess_low: float = 0.6
    ess_high: float = 0.9
    limit: int = 8
    patience: int = 3
    high_streak: int = field(default=0)
    history: list[StalenessDecision] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.max_versions <= self.limit:
            raise ValueError(f"max_versions must be in [0, limit={self.limit}], "
                             f"got {self.max_versions}")
        if not 0 < self.ess_low <= self.ess_high <= 1:
            raise ValueError(f"need 0 < ess_low <= ess_high <= 1, got "
                             f"ess_low={self.ess_low}, ess_high={self.ess_high}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")

    @classmethod
    def from_config(cls, cfg: StalenessConfig, patience: int = 3) -> AdaptiveStaleness:
        """Start from ``cfg.max_versions`` with ``cfg``'s ess_low, ess_high and
        max_versions_limit."""
        if cfg.max_versions > cfg.max_versions_limit:
            raise ValueError(f"staleness.max_versions ({cfg.max_versions}) exceeds "
                             f"staleness.max_versions_limit ({cfg.max_versions_limit})")
        return cls(max_versions=cfg.max_versions, ess_low=cfg.ess_low, ess_high=cfg.ess_high,
                   limit=cfg.max_versions_limit, patience=patience)

    def update(self, ess: float) -> StalenessDecision:
        before = self.max_versions
        action: Literal["shrink", "grow", "hold"] = "hold"
        if math.isnan(ess):
            pass
        elif ess < self.ess_low:
            self.high_streak = 0
            if self.max_versions > 0:
                self.max_versions -= 1
                action = "shrink"
        elif ess > self.ess_high:
            self.high_streak += 1
            if self.high_streak >= self.patience and self.max_versions < self.limit:
                self.max_versions += 1
                self.high_streak = 0
                action = "grow"
        else:
            self.high_streak = 0
        decision = StalenessDecision(action, before, self.max_versions, float(ess),
                                     self.high_streak)
        self.history.append(decision)
        return decision


def staleness(versions: Iterable[int] | Tensor, learner_version: int) -> int:
    """How many policy versions the episode's oldest policy token is behind the learner:
    ``learner_version - min(version)``, ignoring environment tokens (``ENV_VERSION``, -1).

    ``versions`` is an episode's per-token versions (``Episode.versions``, a list or tensor).
    An episode with no policy tokens has staleness 0. Raises ValueError if a token claims a
    version newer than the learner's (the version counters are out of step).
    """
    if isinstance(versions, Tensor):
        versions = versions.flatten().tolist()
    policy_versions = [v for v in versions if v != ENV_VERSION]
    if not policy_versions:
        return 0
    if max(policy_versions) > learner_version:
        raise ValueError(f"episode tokens from policy version {max(policy_versions)} are newer "
                         f"than the learner's version {learner_version}")
    return learner_version - min(policy_versions)


def is_too_stale(versions: Iterable[int] | Tensor, learner_version: int,
                 max_versions: int) -> bool:
    """True when ``staleness(versions, learner_version) > max_versions`` (AReaL's bound)."""
    return staleness(versions, learner_version) > max_versions
