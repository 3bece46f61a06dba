"""reasoning-gym's procedural generators (basic_arithmetic, leg_counting, ...) as single-turn tasks.

The answer is read from the reply in this order: the last ``\\boxed{X}``, else the last
``Answer: X`` line, else the last non-empty line. The reward is reasoning-gym's own
``score_answer`` for the entry; success when it is 1.
"""

from __future__ import annotations

import re
from typing import Any

from turnrl.envs.base import StepResult, register_env
from turnrl.envs.reference import ScriptedReplies


def extract_answer(text: str) -> str:
    """The answer part of a reply: last \\boxed{X}, else last "Answer: X", else last line."""
    if boxed := re.findall(r"\\boxed\{([^{}]*)\}", text):
        return boxed[-1].strip()
    if tagged := re.findall(r"answer\s*[:=]\s*(.+)", text, flags=re.IGNORECASE):
        return tagged[-1].strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def require_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("reasoning-gym is not installed; run: pip install 'turnrl[envs]' "
                          "(or pip install reasoning-gym)") from None
    return reasoning_gym


@register_env("reasoning-gym")
class ReasoningGym:
    """Single turn: a reasoning-gym task (task=basic_arithmetic, ...), scored by its score_answer."""

    system_prompt = "Solve the problem. End your reply with: Answer: <your answer>"

    def __init__(self, task: str = "basic_arithmetic", **task_options: Any):
        self.rg = require_reasoning_gym()
        self.task, self.task_options = task, task_options
        self.entry: dict[str, Any] = {}
        self.dataset: Any = None

    async def reset(self, seed: int) -> str:
        # one entry per seed: a size-1 dataset seeded by the episode seed is deterministic
        self.dataset = self.rg.create_dataset(self.task, size=1, seed=seed, **self.task_options)
        self.entry = self.dataset[0]
        return self.entry["question"]

    async def step(self, action: str) -> StepResult:
        score = float(self.dataset.score_answer(extract_answer(action), self.entry) or 0.0)
        return StepResult("", score, True, {"success": score == 1.0})

    def reference_player(self) -> ScriptedReplies:
        """The oracle for ``sft.env_demos``: the dataset entry's own answer, in the
        ``Answer: X`` form the system prompt asks for. Call it after ``reset``."""
        return ScriptedReplies([f"Answer: {self.entry['answer']}"])
