"""Held-out evaluation: success rate with a Wilson 95% interval, failed episodes counted."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from turnrl.envs.base import Env
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.engine import Engine, SamplingParams
from turnrl.rollout.loop import run_episodes, run_sync
from turnrl.stats import format_rate, wilson_interval
from turnrl.types import Episode

COLUMNS = ["policy", "success [95% CI]", "mean reward", "mean turns", "episodes"]
"""Header of the tables whose rows ``EvalResult.row`` gives."""


@dataclass
class EvalResult:
    episodes: int
    successes: int
    mean_reward: float
    mean_turns: float
    failed: int
    """Episodes that ended by an env timeout or error: counted as failures, not dropped."""

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.successes, self.episodes)

    def row(self, label: str) -> list[str]:
        return [label, format_rate(self.successes, self.episodes), f"{self.mean_reward:.3f}",
                f"{self.mean_turns:.2f}", str(self.episodes)]

    def to_dict(self) -> dict:
        lo, hi = self.interval
        return {**asdict(self), "success_rate": self.success_rate, "ci_lo": lo, "ci_hi": hi}


def summarize(episodes: Sequence[Episode]) -> EvalResult:
    n = len(episodes)
    return EvalResult(
        episodes=n,
        successes=sum(ep.success for ep in episodes),
        mean_reward=sum(ep.reward for ep in episodes) / max(n, 1),
        mean_turns=sum(len(ep.turns) for ep in episodes) / max(n, 1),
        failed=sum(ep.status in ("timeout", "error") for ep in episodes),
    )


def evaluate(make: Callable[[], Env], seeds: Sequence[int], engine: Engine, chat: ChatFormat,
             params: SamplingParams, *, env_name: str, max_turns: int, chunk: int = 32,
             env_timeout_s: float = 30.0, max_context: int | None = None
             ) -> tuple[EvalResult, list[Episode]]:
    """Play one episode per seed (``chunk`` at a time, to bound the batch)."""
    episodes: list[Episode] = []
    for i in range(0, len(seeds), chunk):
        pairs = [(seed, i + j) for j, seed in enumerate(seeds[i:i + chunk])]
        episodes += run_sync(run_episodes(make, pairs, engine, chat, params,
                                             env_name=env_name, max_turns=max_turns,
                                             env_timeout_s=env_timeout_s,
                                             max_context=max_context))
    return summarize(episodes), episodes
