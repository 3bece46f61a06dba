"""The ``distill`` config section: on-policy distillation from a teacher (docs/distill.md).

The student (the policy being trained) samples episodes as usual; the teacher scores the
sampled policy tokens and the per-token reverse KL to it becomes (part of) the advantage.
The maths lives in ``turnrl/algorithms/distill.py``, the teacher in ``turnrl/trainer/distill.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from turnrl.config.types import ConfigError, Section


@dataclass(frozen=True)
class DistillConfig(Section):
    teacher: str = ""
    """the teacher: a model name (tiny, smollm2-135m-instruct), a local Hugging Face model
    directory or a TurnRL checkpoint (RUN_DIR/checkpoints/step-N); it must share the policy's
    tokenizer. Empty = off"""
    coef: float = 1.0
    """weight of the reverse-KL term: each policy token's advantage gains
    -coef * (log p_student - log p_teacher)"""
    only: bool = False
    """the reverse KL is the whole learning signal: the task's advantages are ignored (pure
    on-policy distillation, GKD/MiniLLM style)"""
    baseline: Literal["mean", "none"] = "mean"
    """subtracted from each token's log-prob gap before it becomes an advantage: mean (the
    batch's mean gap over policy tokens: only tokens the teacher likes more or less than
    average move) or none (the raw gap: every sampled token the teacher likes less than the
    student is pushed down)"""

    def _check(self) -> None:
        self._at_least(0, "coef")
        if self.only and not self.teacher:
            raise ConfigError("distill.only needs distill.teacher (there is nothing to distill "
                              "from); name a teacher or drop distill.only")
        if self.only and self.coef == 0:
            raise ConfigError("distill.only with distill.coef 0 leaves no learning signal; "
                              "raise distill.coef")
