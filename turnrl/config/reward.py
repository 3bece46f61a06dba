"""The ``reward`` config section: a reward model that scores finished episodes, and
``turnrl rm``, which trains one (docs/reward_models.md).

The model (``turnrl/rewards/model.py``) scores each step's episodes in the learner process
after they are collected, so sync, async and served runs alike train on
``env_weight * env reward + model_weight * normalised score``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from turnrl.config.types import Section


@dataclass(frozen=True)
class RewardConfig(Section):
    model: str = ""
    """a local Hugging Face sequence-classification model directory with one score
    (num_labels 1), e.g. what turnrl rm wrote; it scores each finished episode's transcript.
    Empty = off"""
    model_weight: float = 1.0
    """weight of the reward model's (normalised) score in an episode's reward"""
    env_weight: float = 1.0
    """weight of the env's own rule reward (0 = the reward model alone)"""
    normalise: Literal["none", "zscore", "sigmoid"] = "none"
    """the score as used: none (raw), zscore (minus the step's mean, over its standard
    deviation) or sigmoid (squashed into (0, 1))"""
    batch_size: int = 8
    """transcripts scored per forward pass"""
    device: str = ""
    """where the reward model runs: cpu, cuda, cuda:1 ('' = model.device)"""
    max_tokens: int = 2048
    """a transcript longer than this is cut from the left (its end is kept)"""

    data: str = ""
    """turnrl rm: JSONL of preference pairs, one a line: {"prompt": ..., "chosen": ...,
    "rejected": ...} (text or lists of chat messages), or {"chosen": [messages],
    "rejected": [messages]}; or a local Hugging Face dataset with those columns (.parquet,
    .arrow, a save_to_disk directory), as sft.data"""
    pair_batch_size: int = 8
    """turnrl rm: pairs per optimisation step"""
    eval_fraction: float = 0.1
    """turnrl rm: share of the pairs held out (seeded by run.seed) for the held-out loss and
    accuracy; at least one when above 0 and there are two or more (as sft.eval_fraction)"""
    eval_every: int = 0
    """turnrl rm: held-out loss and accuracy every N steps (0 = at each checkpoint and the
    last step), as sft.eval_every"""

    def _check(self) -> None:
        for name in ("model_weight", "env_weight"):
            self._require(name, math.isfinite(getattr(self, name)), "a finite number")
        self._at_least(1, "batch_size", "max_tokens", "pair_batch_size")
        self._at_least(0, "eval_every")
        self._require("eval_fraction", 0 <= self.eval_fraction < 1, "in [0, 1)")
