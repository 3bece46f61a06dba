"""The synchronous trainer: collect -> ``rl_step`` -> log, in one loop.

Every stage is named and timed (``time/<stage>_s`` in metrics.jsonl), so the loop reads and
profiles the same way. Run set-up, resume and the before/after evaluation live in
``trainer/run.py``, shared with the async learner.
"""

from __future__ import annotations

from turnrl.config import Config
from turnrl.policy import training_seeds
from turnrl.rollout import run_episodes, run_sync
from turnrl.trainer.rl_step import rl_step
from turnrl.trainer.run import (
    StageTimer,
    TrainResult,
    end_run,
    end_step,
    evaluate_before,
    start_run,
    step_logging,
)


def train(cfg: Config, *, resume: bool = False) -> TrainResult:
    run = start_run(cfg, resume)
    cfg, policy = run.cfg, run.policy
    before = evaluate_before(run)
    with step_logging(run, cfg.env.name) as (logger, progress):
        for step in range(run.start_step, cfg.run.steps):
            timer = StageTimer()
            with timer("collect"):
                episodes = run_sync(run_episodes(
                    policy.make_env, training_seeds(cfg, step), policy.engine, policy.chat,
                    policy.params, env_name=cfg.env.name, max_turns=cfg.rollout.max_turns,
                    max_context=policy.max_context, env_timeout_s=cfg.rollout.env_timeout_s))
            summary, metrics = rl_step(run.learner, episodes, timer)
            policy.engine.version = step + 1  # tokens sampled from now on come from new weights
            end_step(run, step, episodes, summary, metrics, timer, logger, progress)
    return end_run(run, before)
