"""``train(cfg)``: the one learner loop over the source ``run.mode`` picks.

``sync``: a ``LocalSource`` (the learner's own engine, lock-step); ``async``: a ``RaySource``
(Ray rollout workers; joins ``ray.address`` or starts a local cluster, and stops what it
started). The trainer never imports ``turnrl.distributed``: this module joins them.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

from turnrl.config import Config, ConfigError
from turnrl.config.checks import check_learner
from turnrl.distributed.cluster import connect
from turnrl.distributed.source import AsyncTrainResult, RaySource
from turnrl.envs.user_module import load_env_module
from turnrl.leftovers import watched_run
from turnrl.sft.warmup import warm_up
from turnrl.trainer.bookkeeping import TrainResult
from turnrl.trainer.learn import learn
from turnrl.trainer.local import LocalSource


def train_async(cfg: Config, *, resume: bool = False) -> AsyncTrainResult:
    """Train with Ray rollout workers and this process as the learner (``run.mode: async``)."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("run.mode async needs Ray: pip install 'turnrl[ray]'")
    import ray

    started_ray = connect(cfg)
    try:
        return learn(cfg, RaySource(cfg), resume=resume)
    finally:
        if started_ray:
            ray.shutdown()


def train(cfg: Config, *, resume: bool = False) -> TrainResult:
    """``run.mode`` sync: lock-step on this process; async: ``train_async``; first the SFT
    warm-up stage when ``sft.steps`` asks for one (sft/warmup.py). What the envs leave
    behind is dealt with at the end (``turnrl.leftovers.watched_run``), from a script too."""
    return watched_run(lambda: _train(cfg, resume))


def _train(cfg: Config, resume: bool) -> TrainResult:
    cfg = launched_world_size(cfg)
    if cfg.learner.ranked():  # world size 1 too, where fsdp's options ask for one rank
        from turnrl.trainer.ranks import child_ranks, run_as_rank0

        launcher = child_ranks  # at world size 1: no other rank to start
        if cfg.learner.launcher == "ray" and cfg.learner.world_size > 1:
            if importlib.util.find_spec("ray") is None:
                raise ConfigError("learner.launcher ray needs Ray: pip install 'turnrl[ray]'")
            from turnrl.distributed.learner_ranks import ray_ranks as launcher
        return run_as_rank0(cfg, lambda: _train_here(cfg, resume), launcher)
    return _train_here(cfg, resume)


def launched_world_size(cfg: Config) -> Config:
    """``cfg`` with the world size torchrun started (WORLD_SIZE), so the run's config.yaml
    says how many ranks trained it and the options ranks refuse are refused; a different
    ``--learner.world_size`` is refused."""
    launched = int(os.environ.get("WORLD_SIZE", 1))
    if launched == 1 or launched == cfg.learner.world_size:
        return cfg
    if cfg.learner.world_size != 1:
        raise ConfigError(f"learner.world_size {cfg.learner.world_size}, but torchrun started "
                          f"{launched} processes (WORLD_SIZE): drop --learner.world_size or "
                          f"make the two agree")
    cfg = replace(cfg, learner=replace(cfg.learner, world_size=launched))
    check_learner(cfg)  # what ranks cannot do yet is refused under torchrun too
    return cfg


def _train_here(cfg: Config, resume: bool) -> TrainResult:
    load_env_module(cfg.env.module)  # the user's envs: the warm-up may play them already
    cfg, resume = warm_up(cfg, resume=resume)
    if cfg.run.mode == "async":
        return train_async(cfg, resume=resume)
    return learn(cfg, LocalSource(), resume=resume)
