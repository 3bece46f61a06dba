"""Wires a trainer to where its episodes come from: ``train(cfg)`` for either ``run.mode``.

The trainers never import ``turnrl.distributed``; this module (and the CLI through it) is
the one place that joins the async learner loop to Ray rollout workers.
"""

from __future__ import annotations

import importlib.util

from turnrl.config import Config, ConfigError
from turnrl.distributed.fleet import connect, learner_threads
from turnrl.distributed.source import RaySource
from turnrl.trainer.async_ import learn
from turnrl.trainer.run import TrainResult
from turnrl.trainer.sync import train as train_sync


def train_async(cfg: Config, *, resume: bool = False):
    """Train with Ray rollout workers and this process as the learner (``run.mode: async``).

    Joins (``ray.address``) or starts a local Ray cluster, runs the learner loop
    (``turnrl.trainer.async_.learn``) over a ``RaySource``, and stops what it started.
    """
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("run.mode async needs Ray: pip install 'turnrl[ray]'")
    import ray

    started_ray = connect(cfg)
    try:
        return learn(cfg, RaySource.start, resume=resume, threads=learner_threads(cfg))
    finally:
        if started_ray:
            ray.shutdown()


def train(cfg: Config, *, resume: bool = False) -> TrainResult:
    """``run.mode`` sync: ``turnrl.trainer.train``; async: ``train_async``."""
    if cfg.run.mode == "async":
        return train_async(cfg, resume=resume)
    return train_sync(cfg, resume=resume)
