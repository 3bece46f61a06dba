"""Train agent code written against the OpenAI API: ``train_agent(rollout, tasks, cfg)``.

The user's ``async def rollout(client, task) -> float | None`` talks to the policy only
through ``client`` (an ``openai.AsyncOpenAI`` pointed at a live ``turnrl serve`` in this
process) and returns the episode's reward. Training is the one learner loop
(``turnrl.trainer.learn``: collect -> rl_step -> publish -> end_step, as ``turnrl train``)
over a ``ServedSource`` (serve/source.py); ``run.mode`` sync plays each step's tasks against
the current weights, async keeps agents playing while the learner trains.
"""

from __future__ import annotations

from collections.abc import Sequence

from turnrl.config import Config, ConfigError
from turnrl.serve.agents import Judge, Rollout, evaluate_agent, play_groups, self_judge
from turnrl.serve.source import AgentTrainResult, ServedSource, served_config
from turnrl.trainer.learn import learn

__all__ = ["AgentTrainResult", "evaluate_agent", "play_groups", "self_judge", "train_agent"]


def train_agent(rollout: Rollout, tasks: Sequence, cfg: Config, *,
                eval_tasks: Sequence = (), success_at: float = 1.0,
                judge: Judge | str | None = None, resume: bool = False) -> AgentTrainResult:
    """Train the policy of ``cfg`` on ``rollout`` over ``tasks`` (``run.steps`` steps of
    ``rollout.groups_per_step`` tasks, ``rollout.group_size`` runs each); with ``eval_tasks``,
    play them before and after training. ``judge`` ("self": the served policy, or a
    ``Judge``) scores the episodes whose rollout returns None (docs/serving.md: weaker than a
    verifiable reward). ``resume`` continues the run in ``run.out_dir`` from its last
    checkpoint (``run.mode sync`` only). Call it from synchronous code."""
    if resume and cfg.run.mode == "async":
        raise ConfigError("train_agent resume is for run.mode sync; an async run starts afresh")
    if cfg.explore.guidance != "off":  # agent code plays the tasks: there is no env to guide
        raise ConfigError(f"explore.guidance {cfg.explore.guidance} works with turnrl train's envs "
                          "only (it replays an env's seed with its reference player); set it "
                          "off for train_agent")
    if cfg.rollout.branch:  # forks replay an env; agent code behind the endpoint has none
        raise ConfigError("rollout.branch forks turnrl train's env episodes (it replays the "
                          "env); drop it for train_agent")
    source = ServedSource(rollout, tasks, cfg, eval_tasks=eval_tasks, success_at=success_at,
                          judge=judge)
    return learn(served_config(cfg), source, resume=resume)
