"""The synchronous trainer: collect -> ``rl_step`` -> log, in one loop.

Every stage is named and timed (``time/<stage>_s`` in metrics.jsonl), so the loop reads and
profiles the same way. Run set-up, resume and the before/after evaluation live in
``trainer/run.py``, shared with the async learner.
"""

from __future__ import annotations

from dataclasses import replace

from turnrl.algorithms.exploration import dynamic_sampling
from turnrl.config import Config
from turnrl.policy import training_seeds
from turnrl.rollout import run_episodes, run_sync
from turnrl.trainer.rl_step import rl_step
from turnrl.trainer.run import (
    Run,
    StageTimer,
    TrainResult,
    end_run,
    end_step,
    evaluate_before,
    start_run,
    step_logging,
)
from turnrl.types import Episode


def collect(run: Run, seeds: list[tuple[int, int]]) -> list[Episode]:
    """Play ``seeds`` at the step's (scheduled) temperature."""
    cfg, policy = run.cfg, run.policy
    params = replace(policy.params, temperature=run.learner.explore.temperature())
    return run_sync(run_episodes(
        policy.make_env, seeds, policy.engine, policy.chat, params, env_name=cfg.env.name,
        max_turns=cfg.rollout.max_turns, max_context=policy.max_context,
        env_timeout_s=cfg.rollout.env_timeout_s))


def resample_seeds(cfg: Config, step: int, round_: int) -> list[tuple[int, int]]:
    """Fresh groups for dynamic sampling's ``round_``: seeds past every step's own, group ids
    past the step's."""
    groups = cfg.rollout.groups_per_step
    shift = cfg.run.steps * groups * round_
    return [((seed + shift) % cfg.eval.seed_offset, group + groups * round_)
            for seed, group in training_seeds(cfg, step)]


def train(cfg: Config, *, resume: bool = False) -> TrainResult:
    run = start_run(cfg, resume)
    cfg, policy = run.cfg, run.policy
    before = evaluate_before(run)
    with step_logging(run, cfg.env.name) as (logger, progress):
        for step in range(run.start_step, cfg.run.steps):
            timer = StageTimer()
            extra = {}
            with timer("collect"):
                episodes = collect(run, training_seeds(cfg, step))
                if cfg.explore.dynamic_sampling:
                    episodes, extra = dynamic_sampling(
                        episodes, lambda r, s=step: collect(run, resample_seeds(cfg, s, r)),
                        cfg.rollout.groups_per_step, cfg.explore.dynamic_max_rounds)
            summary, metrics = rl_step(run.learner, episodes, timer)
            metrics.update(extra)
            policy.engine.version = step + 1  # tokens sampled from now on come from new weights
            end_step(run, step, episodes, summary, metrics, timer, logger, progress)
    return end_run(run, before)
