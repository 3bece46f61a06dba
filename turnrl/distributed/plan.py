"""What the learner decides for each group it hands out in async mode, and what follows.

The sync trainer plays every group of a step with the step's temperature, on the env the
step's plan builds (trainer/curriculum.py: a curriculum's level, a mix's draw). Ray workers
play groups issued steps ahead, so the learner decides for each group when it issues it and
the assignment carries the decision (``GroupPlan``, book.py); the workers follow:

- temperature (``explore.temperature_schedule``): the schedule's value at the learner's step
  when the group is issued, the step whose weights (or newer) play it. The update scores at
  its own step's temperature, as sync does; a group issued earlier was sampled a little
  hotter or cooler, and decoupled PPO's behaviour weight (on in async mode) corrects for
  that as it does for the older weights (bounded by ``staleness.max_versions``).
- mix entry (``env.mix``): ``mix_choice`` of the run's seed and the group's seed, the draw
  sync makes, so a resumed run (whose seeds go on where they stopped) draws the same.
- curriculum level (``env.curriculum``): the learner's level when it issues the group. Only
  groups played at the current level count towards its window: a group issued before a move
  says nothing about the new level. The level and its window are checkpoint state.

The metrics are sync's: ``env/<label>/*`` over every group the step took (those dynamic
sampling drops included) and ``curriculum/*``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from turnrl.config import Config
from turnrl.distributed.book import GroupPlan
from turnrl.envs import Env
from turnrl.envs.mix import mix_choice
from turnrl.policy import level_factory
from turnrl.rollout.loop import Group
from turnrl.trainer.curriculum import CurriculumState, per_env_metrics, value_metric
from turnrl.types import Episode


class GroupPlanner:
    """The learner's plan for each group it issues (see the module docstring). ``temperature``
    reads the scheduled temperature of the learner's current step (None: no schedule);
    ``saved``: a resumed run's checkpoint state."""

    def __init__(self, cfg: Config, temperature: Callable[[], float] | None = None,
                 saved: dict | None = None) -> None:
        self.cfg = cfg
        self.temperature = (temperature if cfg.explore.temperature_schedule != "constant"
                            else None)
        self.mix = cfg.env.mix_plan()
        plan = cfg.env.curriculum_plan()
        self.curriculum = plan and CurriculumState(plan, (saved or {}).get("curriculum"))
        self.played: list[Episode] = []
        """The step's episodes played at the current level (a mix: every one)."""

    def plan(self, seed: int) -> GroupPlan:
        """The plan of a group of ``seed`` issued now."""
        entry = (mix_choice([e.weight for e in self.mix], self.cfg.run.seed, seed)
                 if self.mix else None)
        return GroupPlan(self.temperature() if self.temperature else None, entry,
                         self.curriculum.level if self.curriculum else None)

    def make(self) -> Callable[[], Env] | None:
        """The env of the current level (guidance replays on it); None: the run's env."""
        return level_factory(self.cfg, self.curriculum.value) if self.curriculum else None

    def record(self, groups: list[Group], plans: dict[int, GroupPlan]) -> None:
        """The step took ``groups`` (``plans``: assignment -> its plan): a mix's episodes
        named by the entry played (in place); those to count kept for ``step_metrics``."""
        for group in groups:
            plan = plans.get(group.assignment, GroupPlan())
            if plan.entry is not None:
                for ep in group.episodes:
                    ep.env = self.mix[plan.entry].label
            if self.curriculum and plan.level != self.curriculum.level:
                continue  # played at another level: not this window's evidence
            self.played += group.episodes

    def step_metrics(self) -> dict[str, float]:
        """``env/<label>/*`` of a mix; ``curriculum/*`` with the step counted (which may move
        the level; a step with no group at the current level only names the level)."""
        played, self.played = self.played, []
        metrics = per_env_metrics(played) if self.mix else {}
        if self.curriculum and played:
            metrics.update(self.curriculum.observe(float(np.mean([ep.success
                                                                   for ep in played]))))
        elif self.curriculum:
            metrics.update({"curriculum/level": float(self.curriculum.level),
                            **value_metric(self.curriculum.value)})
        return metrics

    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict()} if self.curriculum else {}
