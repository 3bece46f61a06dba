"""A reward model's scores joined to each step's episodes (``reward.model``;
docs/reward_models.md).

``learn`` calls ``RewardScorer.apply`` on every step's episodes as they arrive from any
source (lock-step, Ray workers, a served agent), before the update: each episode's reward
becomes ``env_weight * env reward + model_weight * normalised score``. Turn rewards are
kept consistent (each scaled by ``env_weight``, the model's part added to the last turn), so
turn-level estimators see the same return. ``success`` stays the env's own, and held-out
evaluation plays the env alone: the run's success is the task's, whatever the reward model
says (which is what measuring over-optimisation needs).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from turnrl.config import RewardConfig
from turnrl.devices import resolve_device
from turnrl.rewards.model import NORMALISERS, RewardModel, RewardModelError
from turnrl.types import REWARD_LIMIT, Episode


class RewardScorer:
    """The run's reward model and how its scores join the env's rewards."""

    def __init__(self, model: RewardModel, decode, cfg: RewardConfig) -> None:
        self.model, self.decode, self.cfg = model, decode, cfg

    @classmethod
    def for_run(cls, run) -> RewardScorer | None:
        """The scorer ``run``'s config asks for (None: ``reward.model`` is empty)."""
        cfg = run.cfg.reward
        if not cfg.model:
            return None
        tokenizer = run.policy.chat.tokenizer
        device = resolve_device(cfg.device or run.cfg.model.device)
        model = RewardModel.load(cfg.model, policy_tokenizer=tokenizer, device=str(device),
                                 batch_size=cfg.batch_size, max_tokens=cfg.max_tokens)
        print(f"reward model: {cfg.model} on {device}, normalise {cfg.normalise}, reward = "
              f"{cfg.env_weight:g} x env + {cfg.model_weight:g} x model")
        return cls(model, lambda ids: tokenizer.decode(ids, skip_special_tokens=False), cfg)

    def apply(self, episodes: list[Episode]) -> dict[str, float]:
        """Score the episodes that have a policy turn, set every episode's reward (see the
        module docstring); the step's ``reward/*`` metrics of the model and the env."""
        scored = [ep for ep in episodes if ep.turns]
        raw = self.model.score([self.decode(ep.token_ids) for ep in scored])
        used = NORMALISERS[self.cfg.normalise](raw)
        parts = dict(zip(map(id, scored), used.tolist(), strict=True))
        env = [ep.reward for ep in episodes]
        for ep in episodes:
            ep.info["env_reward"] = ep.reward
            set_reward(ep, self.cfg.env_weight, self.cfg.model_weight * parts.get(id(ep), 0.0))
        for ep, score in zip(scored, raw.tolist(), strict=True):
            ep.info["model_score"] = score
        values = raw.numpy()
        return {"reward/model_mean": float(values.mean()) if len(values) else 0.0,
                "reward/model_std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
                "reward/model_used_mean": float(used.mean()) if len(values) else 0.0,
                "reward/env_mean": float(np.mean(env)) if env else 0.0}


def set_reward(episode: Episode, env_weight: float, model_part: float) -> None:
    """``episode``'s reward := env_weight * its reward + model_part; each turn's reward
    scaled by env_weight, model_part added to the last turn's."""
    total = env_weight * episode.reward + model_part
    if not (math.isfinite(total) and abs(total) <= REWARD_LIMIT):
        raise RewardModelError(f"the combined reward {total:g} is not a finite number within "
                               f"±{REWARD_LIMIT:g}; lower reward.model_weight or set "
                               "reward.normalise")
    turns = [replace(t, reward=env_weight * t.reward) for t in episode.turns]
    if turns:
        turns[-1] = replace(turns[-1], reward=turns[-1].reward + model_part)
    episode.turns, episode.reward = turns, total
