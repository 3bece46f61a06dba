"""Shared fixtures: the tiny random model (real tokenizer, real HF Llama) and a toy env."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from turnrl.envs import StepResult, register_env
from turnrl.models import tiny_model

# Benchmarks and their helpers (step_throughput, warmup) live outside the package; tests
# import them as top-level modules, as `python benchmarks/NAME.py` does.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@register_env("say-digit")
class SayDigit:
    """Toy task for the tiny model: reward 1 when the reply starts with a digit."""

    def __init__(self, turns: int = 1):
        self.turns, self.turn = turns, 0

    async def reset(self, seed: int) -> str:
        self.turn = 0
        return "Say a digit."

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        ok = action[:1].isdigit()
        done = self.turn >= self.turns
        return StepResult("Again." if not done else "", float(ok) / self.turns, done,
                          {"success": ok})


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)


@pytest.fixture
def tiny():
    return tiny_model(seed=0)


def groups_within(worker, seconds: float) -> list:
    """The first finished groups a ``RolloutWorker`` reports, polling for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if groups := worker.take_groups(wait_s=1.0).groups:
            return groups
    raise AssertionError(f"the worker returned no group within {seconds:.0f} s")
