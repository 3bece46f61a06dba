"""``LocalSource``: lock-step rollouts on the learner's own engine (``run.mode: sync``).

Each step plays its ``groups_per_step`` groups to the end with the current weights (the turn
loop in lock-step, rollout/loop.py), so the update is on-policy. This source owns the two
options that need that: dynamic sampling (more groups until enough of them have a signal)
and the temperature schedule.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace

from turnrl.algorithms.exploration import dynamic_sampling
from turnrl.checkpoint import load_frozen
from turnrl.config import Config
from turnrl.envs import Env
from turnrl.leftovers import watched_run
from turnrl.policy import publish, training_seeds
from turnrl.rollout import run_episodes, run_sync
from turnrl.selfplay.endpoint import EndpointOpponent
from turnrl.selfplay.opponents import ModelOpponent
from turnrl.selfplay.pool import OpponentPool
from turnrl.trainer.bookkeeping import TrainResult
from turnrl.trainer.curriculum import TrainingEnvs
from turnrl.trainer.guidance import Guidance
from turnrl.trainer.learn import SourceDefaults, learn
from turnrl.trainer.run import Run
from turnrl.types import Episode


def play_seeds(run: Run, seeds: list[tuple[int, int]], make) -> list[Episode]:
    """Play ``(seed, group)`` pairs to the end on the learner's own engine (its current
    weights) at the step's (scheduled) temperature, on envs from ``make``; with
    ``rollout.branch``, each pair grows into a tree of episodes (rollout/branch.py)."""
    cfg, policy = run.cfg, run.policy
    params = replace(policy.params, temperature=run.learner.explore.temperature())
    return run_sync(run_episodes(
        make, seeds, policy.engine, policy.chat, params, env_name=cfg.env.name,
        max_turns=cfg.rollout.max_turns, max_context=policy.max_context,
        env_timeout_s=cfg.rollout.env_timeout_s, branch=cfg.rollout.branch_plan()))


class LocalSource(SourceDefaults):
    """Each step's groups, played by the learner's engine at the scheduled temperature."""

    def open(self, run: Run) -> None:
        self.run = run
        self.extra: dict[str, float] = {}
        self.envs = TrainingEnvs(run)  # a curriculum's level, a mix's labels (curriculum.py)
        self.guidance = Guidance.for_run(run)
        self.pool = opponents(run)
        if isinstance(self.pool, OpponentPool) and run.checkpoint is not None:
            restore_pool(self.pool, run)

    def publish(self, version: int, model) -> None:
        """Tokens from now on are ``version``'s: the learner's engine reloads (``publish``:
        the HF engine where its tensors are, another the published state, LoRA-aware)."""
        publish(self.run.policy.engine, model, version)
        if isinstance(self.pool, OpponentPool):  # a frozen copy every opponent_pool_every
            self.pool.offer(version, model)

    def collect(self, step: int) -> list[Episode]:
        cfg = self.run.cfg
        episodes = self.play(training_seeds(cfg, step))
        self.extra = {}
        if cfg.explore.dynamic_sampling:
            episodes, self.extra = dynamic_sampling(
                episodes, lambda r: self.play(resample_seeds(cfg, step, r)),
                cfg.rollout.groups_per_step, cfg.explore.dynamic_max_rounds)
        if self.guidance is not None:  # all-failed groups get guided episodes
            episodes, guided = self.guidance.apply(episodes, self.run, self.play, self.envs.make)
            self.extra.update(guided)
        return episodes

    def play(self, seeds: list[tuple[int, int]], make: Callable[[], Env] | None = None
             ) -> list[Episode]:
        """Play ``seeds`` at the step's (scheduled) temperature, on envs from ``make`` (default
        the run's env)."""
        guided, make = make is not None, make or self.envs.make
        if self.pool is not None:
            make = self.pool.attach(make)
        episodes = play_seeds(self.run, seeds, make)
        # guided replays (make given) do not count towards a curriculum's success
        return episodes if guided else self.envs.record(episodes)

    def step_metrics(self, step: int, episodes: list[Episode],
                     update_metrics: dict[str, float]) -> dict[str, float]:
        pool = ({"game/pool_versions": float(len(self.pool.members))}
                if isinstance(self.pool, OpponentPool) else {})
        return {**self.extra, **self.envs.step_metrics(), **pool}

    def state_dict(self) -> dict:
        pool = ({POOL_STATE: self.pool.state_dict()} if isinstance(self.pool, OpponentPool)
                else {})
        return {**self.envs.state_dict(),
                **(self.guidance.state_dict() if self.guidance is not None else {}), **pool}

    def frozen_weights(self) -> dict:
        return self.pool.frozen_weights() if isinstance(self.pool, OpponentPool) else {}


POOL_STATE = "opponent_pool"
"""The pool's key in a checkpoint's ``state.json`` (its weights: ``selfplay.pool.member_name``)."""


def saved_pool(run: Run) -> dict | None:
    """The pool entry of the checkpoint ``run`` resumes from (None: not resuming). A
    checkpoint written before pools were saved has none: the pool starts again from the
    resumed weights, with a one-line warning (sync and async runs alike)."""
    if run.checkpoint is None:
        return None
    state = run.checkpoint_state.get(POOL_STATE)
    if state is None:
        warnings.warn(f"checkpoint {run.checkpoint} has no opponent pool (written before pools "
                      f"were checkpointed): the pool starts again from step {run.start_step}'s "
                      "weights, so opponents differ from the interrupted run's", stacklevel=3)
    return state


def restore_pool(pool: OpponentPool, run: Run) -> None:
    """The pool of the checkpoint ``run`` resumes from (``saved_pool``), its members' weights
    read from the checkpoint."""
    state = saved_pool(run)
    if state is None:
        return
    try:
        pool.load_state_dict(state, run.learner.model,
                             lambda name, model: load_frozen(run.checkpoint, name, model))
    except ValueError as err:
        raise ValueError(f"checkpoint {run.checkpoint}: {err}; move that checkpoint aside to "
                         "resume from the one before it") from None


def opponents(run: Run) -> OpponentPool | ModelOpponent | EndpointOpponent | None:
    """Who plays the other seat when it is not the env's own player: the pool of frozen past
    policies (``opponent: pool``), another local model (``opponent: model``), an agent behind
    an OpenAI-compatible endpoint (``opponent: endpoint``), else None."""
    cfg = run.cfg
    opponent = cfg.env.outside_opponent()  # a mix: the one its entries play (config checks)
    if opponent == "model":
        return ModelOpponent.load(cfg.env.opponent_model, cfg)
    if opponent == "endpoint":
        return EndpointOpponent.from_config(cfg)
    if opponent == "pool":
        return OpponentPool(run.policy.chat, run.policy.params, size=cfg.env.opponent_pool_size,
                            every=cfg.env.opponent_pool_every, seed=cfg.run.seed)
    return None


def resample_seeds(cfg: Config, step: int, round_: int) -> list[tuple[int, int]]:
    """Fresh groups for dynamic sampling's ``round_``: seeds past every step's own, group ids
    past the step's."""
    groups = cfg.rollout.groups_per_step
    shift = cfg.run.steps * groups * round_
    return [((seed + shift) % cfg.eval.seed_offset, group + groups * round_)
            for seed, group in training_seeds(cfg, step)]


def train(cfg: Config, *, resume: bool = False) -> TrainResult:
    """Lock-step training on this process's engine (``learn`` over a ``LocalSource``); what
    the envs leave behind is dealt with at the end (``turnrl.leftovers.watched_run``)."""
    return watched_run(lambda: learn(cfg, LocalSource(), resume=resume))
