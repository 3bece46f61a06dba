"""THE learner loop: ``learn(cfg, source)``, for every way episodes arrive.

    collect -> judge (judge.*) -> reward model (reward.model) -> update (rl_step) -> publish
    -> metrics -> end_step          (judge and reward model: off by default)

Where the episodes come from is a ``RolloutSource``; the loop never knows which:

- ``LocalSource`` (trainer/local.py): lock-step; the learner's own engine plays each step's
  groups to the end (on-policy). Owns dynamic sampling and the temperature schedule.
- ``RaySource`` (distributed/source.py): Ray rollout workers generate while the learner
  trains (the AReaL design: Fu et al. 2025, arXiv:2505.24298), groups buffered with bounded
  staleness (trainer/buffer.py), the pool sized from measured rates.
- ``ServedSource`` (serve/source.py): agent code written against the OpenAI API plays a live
  ``turnrl serve``; lock-step or continuous (``run.mode``).
- ``DemonstrationSource`` (sft/train.py, ``turnrl sft``): each step's batch of demonstrations,
  its ``update`` the token NLL of supervised fine-tuning instead of ``rl_step``.

With ``reward.model``, a reward model scores every source's episodes before the update
(trainer/reward_model.py), so it works alike in every mode.

A new way (self-play games, ...) is one more class with these methods; the loop does not
change. Sources that hand over episodes sampled by older weights say so
(``off_policy``): the update then always uses decoupled PPO (``trainer/step.py``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from turnrl.config import Config
from turnrl.evaluation import EvalResult
from turnrl.policy import publish
from turnrl.trainer.bookkeeping import TrainResult, end_step, finish_run, step_logging
from turnrl.trainer.curriculum import held_out_title
from turnrl.trainer.evaluation import base_row, evaluate_env
from turnrl.trainer.judges import build_judge
from turnrl.trainer.reference import reset_reference
from turnrl.trainer.reward_model import RewardScorer
from turnrl.trainer.rl_step import Learner, StageTimer, rl_step
from turnrl.trainer.run import Run, start_run
from turnrl.types import Episode

Update = tuple[EvalResult | None, dict[str, float]]
"""A step's update: the summary of its episodes (None: no reward to show) and its metrics."""


class RolloutSource(Protocol):
    """Where the learner's episodes come from (see the module docstring)."""

    off_policy: bool
    """Episodes may come from older weights: the update uses decoupled PPO."""
    learner_threads: int | None
    """Torch threads for the learner (None: ``run.threads``)."""
    versioned_eval: bool
    """With ``eval.every``, the held-out schedule starts with the base model: the "before"
    evaluation is logged as version 0's row at step 0 (async runs; trainer/evaluation.py)."""

    def open(self, run: Run) -> None:
        """Start what the source needs (workers, a server), where a resumed run left off
        (``run.start_step``, ``run.checkpoint_state``). Called once, after the run is set up."""

    def label(self, cfg: Config) -> str:
        """What the progress bar calls the run."""

    def held_out(self, cfg: Config) -> str:
        """The title of the before/after table (what was evaluated)."""

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """Make ``model``'s weights, as ``version``, the ones new tokens are sampled with."""

    def evaluate(self, run: Run, when: str) -> EvalResult | None:
        """The held-out evaluation ``"before"`` or ``"after"`` training (None: none)."""

    def wait_ready(self) -> None:
        """Block until generation can start; raise if it cannot."""

    def collect(self, step: int) -> list[Episode] | None:
        """The episodes of ``step`` (``rollout.groups_per_step`` groups of them); None: there
        is nothing more to train on, and the run ends before ``step``."""

    def updating(self) -> AbstractContextManager:
        """The context the update runs in (a server shares the weights: it holds its lock)."""

    def update(self, learner: Learner, episodes: list[Episode], timer: StageTimer) -> Update:
        """Train ``learner`` on the step's ``episodes``: ``rl_step``, or SFT's token NLL."""

    def step_metrics(self, step: int, episodes: list[Episode],
                     update_metrics: dict[str, float]) -> dict[str, float]:
        """Metrics of a trained step (staleness, drops, waits); may adapt the source."""

    def progress(self, metrics: dict[str, float]) -> dict:
        """The progress bar's fields of the step's own (beside reward, success, turns)."""

    def state_dict(self) -> dict:
        """What a resume needs, saved with the checkpoint."""

    def frozen_weights(self) -> dict[str, torch.nn.Module]:
        """Further weights a resume needs (an opponent pool's past policies), saved with the
        checkpoint by name (``save_checkpoint``'s ``frozen``); read back from
        ``run.checkpoint`` in ``open``."""

    def close(self) -> None:
        """Stop generating and release what ``open`` started; safe to call twice."""

    def result(self, result: TrainResult) -> TrainResult:
        """The run's result with the source's own books added."""


class SourceDefaults:
    """What most sources do: on-policy, ``rl_step``, env evaluation, nothing to publish, lock
    or save."""

    off_policy = False
    learner_threads: int | None = None
    versioned_eval = False

    def open(self, run: Run) -> None:
        self.run = run

    def label(self, cfg: Config) -> str:
        return cfg.env.name

    def held_out(self, cfg: Config) -> str:
        return held_out_title(cfg)

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """The learner's own sampler (evaluation, self-imitation rounds) takes the weights."""
        run = getattr(self, "run", None)  # a source whose ``open`` keeps no run samples nothing
        if run is not None:
            publish(run.policy.engine, model, version)

    def evaluate(self, run: Run, when: str) -> EvalResult | None:
        return evaluate_env(run, when)

    def wait_ready(self) -> None:
        pass

    def updating(self) -> AbstractContextManager:
        return nullcontext()

    def update(self, learner: Learner, episodes: list[Episode], timer: StageTimer) -> Update:
        return rl_step(learner, episodes, timer)

    def step_metrics(self, step: int, episodes: list[Episode],
                     update_metrics: dict[str, float]) -> dict[str, float]:
        return {}

    def progress(self, metrics: dict[str, float]) -> dict:
        stale = metrics.get("async/staleness_mean")
        return {"stale": None if stale is None else f"{stale:.1f}"}

    def state_dict(self) -> dict:
        return {}

    def frozen_weights(self) -> dict[str, torch.nn.Module]:
        return {}

    def close(self) -> None:
        pass

    def result(self, result: TrainResult) -> TrainResult:
        return result


def scored_episodes(judge, scorer: RewardScorer | None, episodes: list[Episode],
                    timer: StageTimer) -> tuple[list[Episode], dict[str, float]]:
    """The step's episodes rewarded by the judge (``judge.*``), then the reward model
    (``reward.model``, its ``env_weight`` applying to the judged reward), on the learner,
    every mode alike; their metrics. Both off by default: the episodes as they came."""
    metrics: dict[str, float] = {}
    if judge is not None:  # docs/judges.md
        with timer("judge"):
            episodes, metrics = judge.score(episodes)
    if scorer is not None:  # docs/reward_models.md
        with timer("reward_model"):
            metrics = {**metrics, **scorer.apply(episodes)}
    return episodes, metrics


def learn(cfg: Config, source: RolloutSource, *, resume: bool = False) -> TrainResult:
    """Train ``cfg``'s policy for ``run.steps`` steps on the episodes ``source`` delivers;
    ``resume`` continues the run in ``run.out_dir`` from its last checkpoint."""
    run = start_run(cfg, resume, threads=source.learner_threads, decoupled=source.off_policy)
    cfg, model = run.cfg, run.learner.model
    scorer = RewardScorer.for_run(run)  # a bad reward model stops before any source starts
    judge = build_judge(cfg, run.policy.chat.tokenizer)  # None unless judge.* is set
    source.open(run)
    try:
        source.publish(run.start_step, model)
        before = source.evaluate(run, "before")  # while the workers start
        source.wait_ready()
        with step_logging(run, source.label(cfg)) as (logger, progress):
            if source.versioned_eval and (row := base_row(run, before)):
                logger.log(0, row)  # version 0, before the first update
            for step in range(run.start_step, cfg.run.steps):
                timer = StageTimer()
                with timer("collect"):
                    episodes = source.collect(step)
                if episodes is None:  # nothing more to train on
                    break
                episodes, judged = scored_episodes(judge, scorer, episodes, timer)
                with source.updating():
                    summary, metrics = source.update(run.learner, episodes, timer)
                metrics.update(reset_reference(run.learner, step + 1,
                                               cfg.algo.reference_reset_every))
                with timer("publish"):
                    source.publish(step + 1, model)
                metrics.update(judged)
                metrics.update(source.step_metrics(step, episodes, metrics))
                end_step(run, step, episodes, summary, metrics, timer, logger, progress,
                         checkpoint_extra=source.state_dict(),
                         checkpoint_frozen=source.frozen_weights(), **source.progress(metrics))
        after = source.evaluate(run, "after")
        return source.result(finish_run(run, before, after, source.held_out(cfg)))
    finally:
        source.close()
        if judge is not None:
            judge.close()
