"""What the sync trainer plays each step when the env section asks for more than one env:
a curriculum's current level (``env.curriculum``) or a mix's per-env books (``env.mix``).

Curriculum rule (``next_level``, pure): the step's training success rates are collected for
``window`` steps at a level; then their mean above ``band[1]`` moves one level harder, below
``band[0]`` one level easier (never past either end), and a fresh window starts. The level and
the open window are checkpoint state, so a resumed run continues where it stood.
docs/curriculum.md has the whole story.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from turnrl.config import Config, Curriculum
from turnrl.envs import Env
from turnrl.envs.mix import mix_choice
from turnrl.policy import level_factory
from turnrl.selfplay.outcomes import role_outcomes
from turnrl.trainer.run import Run
from turnrl.types import Episode


def next_level(level: int, levels: int, success: float, band: tuple[float, float]) -> int:
    """The level after a full window with mean training ``success`` at ``level`` (of
    ``levels``): one up above the band, one down below it, else the same; bounded."""
    low, high = band
    if success > high:
        return min(level + 1, levels - 1)
    if success < low:
        return max(level - 1, 0)
    return level


def value_metric(value: object) -> dict[str, float]:
    """``curriculum/value`` for a numeric level value (a string or mapping has none)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return {"curriculum/value": float(value)}
    return {}


def held_out_title(cfg: Config) -> str:
    """What the before/after table evaluated: the env, a curriculum's (hardest) level, a mix's
    envs."""
    plan, mix, episodes = cfg.env.curriculum_plan(), cfg.env.mix_plan(), cfg.eval.episodes
    if plan:
        return (f"{cfg.env.name} at {plan.option}={plan.levels[-1]!r} (the hardest level): "
                f"{episodes} held-out episodes")
    if mix:
        return (f"mix of {', '.join(e.label for e in mix)}: {episodes} held-out episodes "
                "per env")
    return f"{cfg.env.name}: {episodes} held-out episodes"


class CurriculumState:
    """The level and the success rates of the window under way, advanced once per step."""

    def __init__(self, plan: Curriculum, saved: dict | None = None) -> None:
        self.plan = plan
        saved = saved or {}
        self.level = min(int(saved.get("level", 0)), len(plan.levels) - 1)
        self.window: list[float] = [float(s) for s in saved.get("window", [])]

    @property
    def value(self) -> object:
        return self.plan.levels[self.level]

    def observe(self, success: float) -> dict[str, float]:
        """Count a step's training success; move when the window is full. The metrics name
        the level the step played and the window's mean so far."""
        played, value = self.level, self.value
        self.window.append(success)
        mean = float(np.mean(self.window))
        if len(self.window) >= self.plan.window:
            self.level = next_level(self.level, len(self.plan.levels), mean, self.plan.band)
            self.window = []
            if self.level != played:
                print(f"curriculum: {self.plan.option} {value!r} -> {self.value!r} (level "
                      f"{played} -> {self.level}, training success {mean:.2f} over "
                      f"{self.plan.window} steps, band {list(self.plan.band)})")
        return {"curriculum/level": float(played), **value_metric(value),
                "curriculum/success": mean, "curriculum/move": float(self.level - played)}

    def state_dict(self) -> dict:
        return {"level": self.level, "window": list(self.window)}


def mix_labels(cfg: Config) -> Callable[[int], str]:
    """Env seed -> the label of the env a mix plays for it (``mix_choice``)."""
    mix = cfg.env.mix_plan()
    weights, labels = [e.weight for e in mix], [e.label for e in mix]
    return lambda seed: labels[mix_choice(weights, cfg.run.seed, seed)]


def per_env_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """``env/<label>/reward``, ``/success`` and ``/episodes`` per env the step played; a game
    with roles (self-play: one episode per seat) also ``env/<label>/<role>/win`` and
    ``/reward`` (the step's ``game/<role>/...`` pool every env whose seats share a role's name)."""
    metrics: dict[str, float] = {}
    for label in sorted({ep.env for ep in episodes}):
        mine = [ep for ep in episodes if ep.env == label]
        metrics[f"env/{label}/reward"] = float(np.mean([ep.reward for ep in mine]))
        metrics[f"env/{label}/success"] = float(np.mean([ep.success for ep in mine]))
        metrics[f"env/{label}/episodes"] = float(len(mine))
        for role, row in role_outcomes(mine).items():
            metrics[f"env/{label}/{role}/win"] = row["win"]
            metrics[f"env/{label}/{role}/reward"] = row["reward"]
    return metrics


class TrainingEnvs:
    """The env each step plays, and what the env plan logs and checkpoints (a run without a
    curriculum or a mix plays ``policy.make_env`` and logs nothing here)."""

    def __init__(self, run: Run) -> None:
        cfg = run.cfg
        plan = cfg.env.curriculum_plan()
        self.curriculum = plan and CurriculumState(
            plan, run.checkpoint_state.get("curriculum"))
        self.level_makes = [level_factory(cfg, v) for v in plan.levels] if plan else []
        self.default = run.policy.make_env
        self.label_of = mix_labels(cfg) if cfg.env.mix else None
        self.played: list[Episode] = []
        """Every episode the step played so far, groups dynamic sampling drops included."""

    def make(self) -> Env:
        """A fresh env at the current level (the run's env without a curriculum)."""
        if self.curriculum:
            return self.level_makes[self.curriculum.level]()
        return self.default()

    def record(self, episodes: list[Episode]) -> list[Episode]:
        """Count ``episodes`` as played this step; name each mixed episode's env by the label
        drawn for its seed (in place)."""
        if self.label_of:
            for ep in episodes:
                ep.env = self.label_of(ep.seed)
        self.played += episodes
        return episodes

    def step_metrics(self) -> dict[str, float]:
        """Per-env metrics of a mix; a curriculum's step counted (which may move it). Both
        measure every episode the step played: the groups dynamic sampling kept would
        overstate a mixed success and hide all-solved and all-failed groups."""
        played, self.played = self.played, []
        metrics = per_env_metrics(played) if self.label_of else {}
        if self.curriculum and played:
            success = float(np.mean([ep.success for ep in played]))
            metrics.update(self.curriculum.observe(success))
        return metrics

    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict()} if self.curriculum else {}
