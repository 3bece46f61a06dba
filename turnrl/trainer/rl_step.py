"""One RL step on a batch of finished episodes: advantages -> batch -> update -> metrics.

Every mode calls this one function: the sync trainer on the episodes it just collected, the
async learner on the groups its rollout source delivered, the step-throughput benchmark on
its fixed workload. The step's own types live here too: the ``Learner`` it updates, the
``StageTimer`` it times its stages with, ``episode_metrics`` (what its episodes say).
Collecting episodes (the turn loop) and what follows a step (logging, evaluation,
checkpoints: ``trainer/bookkeeping.py``'s ``end_step``) stay outside, so the RL maths reads
in one place: here, ``algorithms/estimators.py`` (advantages) and ``trainer/step.py`` (the
update).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from turnrl.algorithms.estimators import AdvantageEstimator
from turnrl.algorithms.exploration import Exploration
from turnrl.algorithms.replay import SuccessReplay
from turnrl.config import DistillConfig, ExploreConfig
from turnrl.evaluation import EvalResult, count_end_reasons, summarize
from turnrl.learner.share import Share, global_totals, split_rows
from turnrl.learner.world import World
from turnrl.selfplay.outcomes import game_step_metrics
from turnrl.trainer.collapse import CollapseMonitor
from turnrl.trainer.distill import distill_batch
from turnrl.trainer.prefix import shared_prefix_split
from turnrl.trainer.step import (
    UpdateSettings,
    policy_rows,
    policy_update,
    skipped_update,
    uses_proximal,
    with_proximal_logprobs,
)
from turnrl.types import Batch, Episode


@dataclass
class Learner:
    """What one RL step needs: the model it updates and how (see ``rl_step``)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    settings: UpdateSettings
    estimator: AdvantageEstimator
    pad_id: int
    ref_model: torch.nn.Module | None = None
    explore: Exploration = field(default_factory=lambda: Exploration(
        ExploreConfig(), steps=1, temperature=1.0, entropy_coef=0.0, max_policy_tokens=1))
    """The ``explore`` options' stage (off by default)."""
    teacher: torch.nn.Module | None = None
    """The frozen teacher of on-policy distillation (``distill``; None = off)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    world: World | None = None
    """The learner ranks the model is split over (None: this process alone)."""
    replay: SuccessReplay | None = None
    """Past successes added to all-failed groups (``explore.success_replay_age``; None = off)."""
    collapse: CollapseMonitor | None = None
    """The template-collapse monitor (``run.collapse_every``; None = off)."""


class StageTimer:
    """``with timer("collect"): ...`` accumulates wall seconds per named stage."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``time/<stage>_s`` per stage and ``time/step_s`` since the timer was made."""
        return {**{f"time/{k}_s": v for k, v in self.seconds.items()},
                "time/step_s": time.perf_counter() - self.started}


def rl_step(learner: Learner, episodes: list[Episode], timer: StageTimer
            ) -> tuple[EvalResult, dict[str, float]]:
    """Update ``learner.model`` on ``episodes``; return their summary and the step's metrics.

    Stages (timed into ``timer``): ``advantages`` (the estimator; a turn-level critic also
    trains here), ``collapse`` (when due: the template-collapse monitor scores a few replies
    under the batch's other contexts, ``trainer/collapse.py``; not with learner ranks),
    ``update`` (``policy_update``: one optimiser step per ``algo.epochs``; with
    decoupled PPO and several epochs it first scores the proximal policy), ``log``. With a
    ``distill.teacher``, ``teacher`` (between the two) scores the policy tokens under it and
    adds the per-token reverse-KL advantage (``trainer/distill.py``).
    """
    played, replay_metrics = episodes, {}
    if learner.replay is not None and (learner.world is None or learner.world.leader):
        episodes, replay_metrics = learner.replay.mix(episodes)
    if learner.world is not None and learner.world.leader:  # every rank updates in step
        learner.world.command("update", episodes)
    if not any(ep.num_policy_tokens for ep in episodes):
        return skipped_step(learner, episodes, timer)
    explore = learner.explore
    with timer("advantages"):
        # The estimator sees shaped rewards (novelty, overlong); the logs the env's own.
        scored = explore.shaped(episodes)
        advantages = learner.estimator.advantages(scored, learner.model, learner.pad_id)
        batch = Batch.from_episodes(episodes, explore.advantages(scored, advantages),
                                    learner.pad_id)
        batch = replace(batch, loss_mask=explore.loss_mask(episodes, batch.loss_mask))
    collapse_metrics = {}
    if learner.collapse is not None and learner.world is None and learner.collapse.due():
        with timer("collapse"):  # this step's own replies (no replayed ones), before the update
            collapse_metrics = learner.collapse.metrics(
                learner.model, policy_episodes(played), explore_settings(learner).temperature,
                learner.pad_id)
    distill_metrics = {}
    if learner.teacher is not None:
        with timer("teacher"):  # the reverse KL to the teacher joins the advantages
            batch, distill_metrics = distill_batch(learner.teacher, batch,
                                                   explore_settings(learner), learner.distill)
    with timer("update"):
        if learner.world is None:
            update_metrics = policy_update(learner.model, learner.optimizer, batch,
                                           explore_settings(learner), learner.ref_model)
        else:
            update_metrics = ranks_update(learner, batch, explore_settings(learner))
    with timer("log"):
        summary, metrics = episode_metrics(policy_episodes(played))
        metrics.update(update_metrics)
        metrics.update(replay_metrics)
        metrics.update(distill_metrics)
        metrics.update(collapse_metrics)
        metrics.update(learner.estimator.metrics())
        metrics.update(explore.end_step(update_metrics))
    return summary, metrics


def ranks_update(learner: Learner, batch: Batch, settings: UpdateSettings) -> dict[str, float]:
    """``policy_update`` on this rank's share of ``batch`` (every rank holds all of it),
    equal to the one-process update on all of it (``turnrl.learner.share``). Rank 0's
    advantages and loss mask are taken, so a critic or a stateful shaping on another rank
    can never train on other numbers."""
    world, model = learner.world, learner.model
    batch = replace(batch, advantages=world.broadcast(batch.advantages.contiguous()),
                    loss_mask=world.broadcast(batch.loss_mask.contiguous()))
    if (skip := skipped_update(batch, settings)) is not None:
        return skip
    if uses_proximal(settings.algo) and settings.algo.epochs > 1:
        # every rank scores the whole batch: FSDP's gathers stay in step, no rows to send
        batch = with_proximal_logprobs(model, batch, settings)
    split = shared_prefix_split(batch)
    owners = split.owner.tolist() if split is not None else list(range(len(batch)))
    scored = batch.loss_mask.bool().any(dim=1)
    tokens = (batch.attention_mask.sum(dim=1) * scored).tolist()
    rows = split_rows(owners, tokens, world.size)[world.rank]
    share = Share(world, global_totals(batch), batch.select(policy_rows(batch)[:1]))
    return policy_update(model, learner.optimizer,
                         batch.select(torch.tensor(rows, dtype=torch.long)), settings,
                         learner.ref_model, share=share)


def skipped_step(learner: Learner, episodes: list[Episode], timer: StageTimer
                 ) -> tuple[EvalResult, dict[str, float]]:
    """A step none of whose episodes has a policy token: each ended before the policy's first
    reply (a prompt too long for the context, ``input_too_large``; a reset that failed or
    timed out). There is nothing to learn from, so no update: a warning says why, the
    progress line shows ``WARN=no_policy_tokens``, and the run goes on."""
    reasons = ", ".join(f"{n} {reason}" for reason, n in count_end_reasons(episodes).items())
    example = next((ep.info["reason"] for ep in episodes if ep.info.get("reason")), "")
    warnings.warn(f"update skipped: none of the step's {len(episodes)} episodes has a policy "
                  f"token ({reasons}){f'; e.g. {example}' if example else ''}; the weights "
                  "are unchanged", stacklevel=2)
    with timer("log"):
        summary, metrics = episode_metrics(policy_episodes(episodes))
        metrics.update({"update/skipped": float(learner.settings.algo.epochs),
                        "warn/no_policy_tokens": 1.0})
        metrics.update(learner.explore.end_step({}))
    return summary, metrics


def episode_metrics(episodes: list[Episode]) -> tuple[EvalResult, dict[str, float]]:
    """What a step's episodes say: reward, success, length."""
    summary = summarize(episodes)
    rewards = [ep.reward for ep in episodes]
    return summary, {
        "reward/mean": summary.mean_reward,
        "reward/std": float(np.std(rewards, ddof=1)) if len(rewards) > 1 else 0.0,
        "success/rate": summary.success_rate,
        "episode/turns": summary.mean_turns,
        "episode/tokens": float(np.mean([len(ep.token_ids) for ep in episodes])),
        "episode/policy_tokens": float(np.mean([ep.num_policy_tokens for ep in episodes])),
        "episode/failed": summary.failed,
        **game_step_metrics(episodes),
    }


def policy_episodes(episodes: list[Episode]) -> list[Episode]:
    """The episodes the policy played unguided (guided ones, ``info["guided"]``, train but
    would inflate the step's reward and success: explore.guidance, trainer/guidance.py)."""
    return [ep for ep in episodes if "guided" not in ep.info] or episodes


def explore_settings(learner: Learner) -> UpdateSettings:
    """The step's update settings: the scheduled temperature (the one the episodes were
    sampled at), the adaptive entropy coefficient, the top-entropy share (``explore``)."""
    s, explore = learner.settings, learner.explore
    algo = s.algo
    if explore.cfg.entropy_target:
        algo = replace(algo, entropy_coef=explore.entropy_coef)
    temperature = (explore.temperature() if explore.cfg.temperature_schedule != "constant"
                   else s.temperature)
    return replace(s, algo=algo, temperature=temperature,
                   top_entropy_fraction=explore.cfg.top_entropy_fraction)
