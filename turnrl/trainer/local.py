"""``LocalSource``: lock-step rollouts on the learner's own engine (``run.mode: sync``).

Each step plays its ``groups_per_step`` groups to the end with the current weights (the turn
loop in lock-step, rollout/loop.py), so the update is on-policy. This source owns the two
options that need that: dynamic sampling (more groups until enough of them have a signal)
and the temperature schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from turnrl.algorithms.exploration import dynamic_sampling
from turnrl.config import Config
from turnrl.envs import Env
from turnrl.lora import published_state
from turnrl.policy import training_seeds
from turnrl.rollout import run_episodes, run_sync
from turnrl.trainer.curriculum import TrainingEnvs
from turnrl.trainer.guidance import Guidance
from turnrl.trainer.learn import SourceDefaults, learn
from turnrl.trainer.run import Run, TrainResult
from turnrl.types import Episode


class LocalSource(SourceDefaults):
    """Each step's groups, played by the learner's engine at the scheduled temperature."""

    def open(self, run: Run) -> None:
        self.run = run
        self.extra: dict[str, float] = {}
        self.envs = TrainingEnvs(run)  # a curriculum's level, a mix's labels (curriculum.py)
        explore = run.cfg.explore
        self.guidance = (Guidance(explore.guidance, explore.guidance_attempts)
                         if explore.guidance != "off" else None)

    def publish(self, version: int, model) -> None:
        """The HF engine samples from the learner's own tensors; another engine (vLLM)
        reloads them as ``version``."""
        engine = self.run.policy.engine
        if hasattr(engine, "update_weights"):
            engine.update_weights(published_state(model), version)  # LoRA: the adapter

    def collect(self, step: int) -> list[Episode]:
        cfg = self.run.cfg
        episodes = self.play(training_seeds(cfg, step))
        self.extra = {}
        if cfg.explore.dynamic_sampling:
            episodes, self.extra = dynamic_sampling(
                episodes, lambda r: self.play(resample_seeds(cfg, step, r)),
                cfg.rollout.groups_per_step, cfg.explore.dynamic_max_rounds)
        if self.guidance is not None:  # all-failed groups get guided episodes
            episodes, guided = self.guidance.apply(episodes, self.run, self.play)
            self.extra.update(guided)
        return episodes

    def play(self, seeds: list[tuple[int, int]], make: Callable[[], Env] | None = None
             ) -> list[Episode]:
        """Play ``seeds`` at the step's (scheduled) temperature, on envs from ``make`` (default
        the run's env)."""
        run = self.run
        cfg, policy = run.cfg, run.policy
        params = replace(policy.params, temperature=run.learner.explore.temperature())
        episodes = run_sync(run_episodes(
            make or self.envs.make, seeds, policy.engine, policy.chat, params,
            env_name=cfg.env.name, max_turns=cfg.rollout.max_turns,
            max_context=policy.max_context, env_timeout_s=cfg.rollout.env_timeout_s))
        # guided replays (make given) do not count towards a curriculum's success
        return episodes if make is not None else self.envs.record(episodes)

    def step_metrics(self, step: int, episodes: list[Episode],
                     update_metrics: dict[str, float]) -> dict[str, float]:
        return {**self.extra, **self.envs.step_metrics()}

    def state_dict(self) -> dict:
        return self.envs.state_dict()


def resample_seeds(cfg: Config, step: int, round_: int) -> list[tuple[int, int]]:
    """Fresh groups for dynamic sampling's ``round_``: seeds past every step's own, group ids
    past the step's."""
    groups = cfg.rollout.groups_per_step
    shift = cfg.run.steps * groups * round_
    return [((seed + shift) % cfg.eval.seed_offset, group + groups * round_)
            for seed, group in training_seeds(cfg, step)]


def train(cfg: Config, *, resume: bool = False) -> TrainResult:
    """Lock-step training on this process's engine (``learn`` over a ``LocalSource``)."""
    return learn(cfg, LocalSource(), resume=resume)
