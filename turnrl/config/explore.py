"""The ``explore`` config section: exploration and stability options (docs/exploration.md).

Every option is off by default (the run is then exactly plain GRPO/PPO); they combine freely.
The maths lives in ``turnrl/algorithms/exploration.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from turnrl.config.types import Section


@dataclass(frozen=True)
class ExploreConfig(Section):
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage) and
    collect groups on fresh seeds until groups_per_step informative ones are in (sync; async:
    the learner takes more of the workers' groups)"""
    dynamic_max_rounds: int = 3
    """most extra collection rounds a step may take to fill its batch (then it trains on the
    informative groups it has)"""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: over the last this many policy tokens before
    overlong_max_tokens the reward falls linearly by up to overlong_penalty (0 = off)"""
    overlong_max_tokens: int = 0
    """policy-token length of an episode at which the full penalty applies; 0 means
    rollout.max_new_tokens * rollout.max_turns"""
    overlong_penalty: float = 1.0
    """the largest overlong punishment, subtracted from the reward"""
    mask_truncated: bool = False
    """DAPO overlong filtering: truncated episodes (out of turns or context, or the last reply
    cut at max_new_tokens) contribute no loss"""
    top_entropy_fraction: float = 1.0
    """train only on this share of the batch's policy tokens with the highest entropy
    (Wang et al. 2025 use 0.2); 1 = every token"""
    entropy_target: float = 0.0
    """adaptive entropy bonus: steer the coefficient so the policy entropy (nats/token)
    tracks this target; 0 = off (algo.entropy_coef is then a fixed bonus)"""
    entropy_coef_rate: float = 0.01
    """controller gain: coefficient change per nat of (target - entropy) per step"""
    entropy_coef_max: float = 0.05
    """the adaptive coefficient stays in [0, this]"""
    temperature_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """sampling temperature over training steps, from rollout.temperature to
    temperature_end; async mode: each group at the learner's step when it was issued
    (rollout.sampler hf or vllm; docs/async.md)"""
    temperature_end: float = 1.0
    """temperature at the last step for the linear and cosine schedules"""
    positive_weight: float = 1.0
    """multiplies positive advantages (samples better than their group)"""
    negative_weight: float = 1.0
    """multiplies negative advantages (samples worse than their group)"""
    pass_k: int = 0
    """pass@k training (Chen et al. 2025): replace outcome advantages by the analytic
    pass@k group advantages over episode success, k <= group_size; 0 = off"""
    novelty_coef: float = 0.0
    """count-based state-novelty bonus beta / sqrt(N(s)) per turn, over hashed env states
    counted across training (Tang et al. 2017); 0 = off"""
    warn_entropy_fraction: float = 0.1
    """warn (warn/entropy_collapse) when entropy falls below this fraction of the first
    step's; 0 = never"""
    warn_clip_fraction: float = 0.3
    """warn (warn/clip_extreme) when the clip fraction stays above this; 1 = never"""
    warn_patience: int = 3
    """consecutive steps a condition must hold before its warning fires"""
    guidance: Literal["off", "demo", "hint"] = "off"
    """when every episode of a group fails (no reward signal): demo adds the env's reference
    player's successful episode on that seed to the group, hint replays the seed with a hint
    in the prompt (the env's hint(level), else part of the player's first reply; the level
    adapts per task); sync and async modes (docs/guidance.md)"""
    guidance_attempts: int = 2
    """hint: hinted episodes added to an all-failed group (demo adds one demonstration)"""
    success_replay_age: int = 0
    """success replay (ARPO, SPEAR): each task's latest successful episode is kept this many
    steps and added to a later group of the same task (the same prompt) in which nothing
    succeeded; off-policy, so the update uses decoupled PPO; 0 = off
    (algorithms/replay.py)"""
    hint_levels: int = 3
    """hint: how many levels of hint, from 1 (the least) to this (the player's whole first
    reply); a task's level rises while its groups fail and falls as they succeed"""

    def _check(self) -> None:
        self._at_least(0, "dynamic_max_rounds", "overlong_buffer", "overlong_max_tokens",
                       "overlong_penalty", "entropy_target", "entropy_coef_rate",
                       "entropy_coef_max", "temperature_end", "positive_weight",
                       "negative_weight", "pass_k", "novelty_coef", "warn_entropy_fraction",
                       "success_replay_age")
        self._require("top_entropy_fraction", 0 < self.top_entropy_fraction <= 1, "in (0, 1]")
        self._require("warn_clip_fraction", 0 <= self.warn_clip_fraction <= 1, "in [0, 1]")
        self._at_least(1, "warn_patience", "guidance_attempts", "hint_levels")
