"""The asynchronous learner: rollout workers generate while the learner trains.

Two loops run at once (the AReaL design: Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
Reinforcement Learning System for Language Reasoning", arXiv:2505.24298):

- the **rollout loop**, in each worker (turnrl/rollout/loop.py, run by
  turnrl/distributed/workers.py): a pool of live episodes continued in batched generate
  calls, environment steps running concurrently, new groups started as old ones finish, and
  the newest weights swapped in between generate calls. With partial rollouts (APRIL: Zhou
  et al. 2025, arXiv:2509.18521) an episode in flight keeps going across a weight swap, so
  its tokens can come from several policy versions (``Episode.versions`` records which);
- the **learner loop**, here: take ``groups_per_step`` fresh enough groups from the rollout
  source, run the one ``rl_step`` (the sync trainer's), publish the new weights, log and
  checkpoint. It never waits for a generation to finish, only for enough of them.

Between them sits the **buffer** with bounded staleness, owned by the ``RolloutSource``
(turnrl/distributed/source.py for Ray workers): it hands out the work, keeps what arrived
beyond a step's need, and drops or regenerates groups whose oldest policy token is more
than ``staleness.max_versions`` behind. This module never imports Ray or the distributed
package; ``turnrl.launch.train_async`` wires the two.

Decoupled PPO is always on here (``algo.decoupled`` is forced): the behaviour
log-probabilities are the ones the workers sampled (possibly from several versions), the
proximal ones are the learner's weights right before the update (with one epoch, the
update's own forward pass; with more, one extra scoring pass in ``policy_update``);
``policy_update`` keeps the trust region around the proximal policy and weights each token
by proximal / behaviour. Its ESS drives ``staleness.adaptive``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from turnrl.config import Config
from turnrl.rollout.loop import Group
from turnrl.trainer.rl_step import rl_step
from turnrl.trainer.run import (
    Learner,
    StageTimer,
    TrainResult,
    end_run,
    end_step,
    evaluate_before,
    start_run,
    step_logging,
)


class RolloutSource(Protocol):
    """Where the async learner's groups come from (``RaySource``: Ray rollout workers)."""

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """Make ``model``'s weights, as ``version``, the ones new tokens are sampled with."""

    def wait_ready(self) -> None:
        """Block until generation can start (workers built); raise if it cannot."""

    def collect(self, need: int) -> list[Group]:
        """``need`` finished groups, fresh enough for the last published version."""

    def step_metrics(self, step: int, groups: list[Group],
                     update_metrics: dict[str, float]) -> dict[str, float]:
        """Metrics of a trained step (staleness, drops, waits); may adapt the bound."""

    def state_dict(self) -> dict:
        """What a resume needs, saved with the checkpoint."""

    def close(self) -> dict:
        """Stop generating; the books' totals (``AsyncTrainResult`` fields)."""


SourceFactory = Callable[[Config, Path, dict, int], RolloutSource]
"""``(cfg, run_dir, resumed checkpoint state, start step) -> RolloutSource``."""


@dataclass
class AsyncTrainResult(TrainResult):
    """``TrainResult`` plus the learner's books: what it trained on, and what else happened."""

    trained: list[tuple[int, int]] = field(default_factory=list)
    """(assignment, seed) of every group trained on, in training order."""
    dropped: list[int] = field(default_factory=list)
    regenerated: list[int] = field(default_factory=list)
    reissued: list[int] = field(default_factory=list)
    """Assignments re-sent because the worker holding them was restarted or given up."""
    abandoned: list[int] = field(default_factory=list)
    """Outstanding (or delivered but unused) when the run ended."""
    duplicates: int = 0
    worker_restarts: int = 0
    issued: dict[int, int] = field(default_factory=dict)
    """Every assignment id handed out in this process -> its seed."""


def learn(cfg: Config, make_source: SourceFactory, *, resume: bool = False,
          threads: int | None = None,
          adapt_learner: Callable[[Learner], Learner] | None = None) -> AsyncTrainResult:
    """The learner loop over groups from ``make_source`` (same run directory as ``train``).
    ``adapt_learner`` may wrap the learner built from ``cfg`` (``train_agent`` shares an
    episode's advantage between its segments)."""
    run = start_run(cfg, resume, threads=threads, decoupled=True)
    if adapt_learner is not None:
        run.learner = adapt_learner(run.learner)
    cfg, policy, model = run.cfg, run.policy, run.learner.model
    source = make_source(cfg, run.run_dir, run.checkpoint_state, run.start_step)
    try:
        source.publish(run.start_step, model)
        before = evaluate_before(run)  # while the workers start
        source.wait_ready()
        with step_logging(run, f"{cfg.env.name} (async)") as (logger, progress):
            for step in range(run.start_step, cfg.run.steps):
                timer = StageTimer()
                with timer("collect"):
                    groups = source.collect(cfg.rollout.groups_per_step)
                    episodes = [ep for g in groups for ep in g.episodes]
                summary, metrics = rl_step(run.learner, episodes, timer)
                policy.engine.version = step + 1  # the learner's own (eval) engine
                with timer("publish"):
                    source.publish(step + 1, model)
                metrics.update(source.step_metrics(step, groups, metrics))
                end_step(run, step, episodes, summary, metrics, timer, logger, progress,
                         checkpoint_extra=source.state_dict(),
                         stale=f"{metrics['async/staleness_mean']:.1f}")
        books = source.close()  # the after-evaluation needs the cores more than generation
        result = end_run(run, before)
        return AsyncTrainResult(**vars(result), **books)
    finally:
        source.close()
