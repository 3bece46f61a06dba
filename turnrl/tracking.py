"""Experiment trackers that mirror ``metrics.jsonl``: TensorBoard, W&B, Trackio, MLflow.

Each tracker is a small object with ``log(step, scalars)`` and ``close()``; ``MetricsLogger``
(``metrics.py``) writes its durable line first, then hands the same numbers to each. All of
them work offline: TensorBoard writes event files under the run directory, W&B as its own
settings say (``WANDB_MODE=offline`` keeps it local), Trackio into its local SQLite store
(``TRACKIO_DIR``, by default ``~/.cache/huggingface/trackio``; no Space unless the user's
environment names one), MLflow into a file store under the run directory unless
``MLFLOW_TRACKING_URI`` names another. docs/monitoring.md says how to read each back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from turnrl.config.types import ConfigError

__all__ = ["Tracker", "open_tracker"]

INSTALL = "pip install 'turnrl[tracking]'"


class Tracker(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _require(module: str, tracker: str) -> Any:
    """Import ``module`` or fail in one line naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"run.tracking names {tracker} but {module} cannot be imported "
                          f"(not installed): {INSTALL}") from None


class TensorBoardTracker:
    """Event files under ``run_dir/tensorboard`` (``tensorboard --logdir RUN_DIR``)."""

    def __init__(self, run_dir: Path) -> None:
        # torch ships this module; importing it fails without the tensorboard package
        board = _require("torch.utils.tensorboard", "tensorboard")
        self.writer = board.SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run in ``project``, its files under the run directory."""

    def __init__(self, run_dir: Path, project: str, config: dict | None) -> None:
        wandb = _require("wandb", "wandb")
        self.run = wandb.init(project=project, config=config, dir=str(run_dir))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    """A Trackio run named after the run directory in ``project``: local unless the user's
    environment sets ``TRACKIO_SPACE_ID`` or ``TRACKIO_SERVER_URL``
    (``trackio show --project PROJECT`` opens its dashboard)."""

    def __init__(self, run_dir: Path, project: str, config: dict | None) -> None:
        self.trackio = _require("trackio", "trackio")
        self.run = self.trackio.init(project=project, name=run_dir.name, config=config,
                                     resume="allow")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        # trackio.finish, not run.finish: it also forgets the current run, which trackio
        # would otherwise finish again at exit
        self.trackio.finish()


def mlflow_uri(run_dir: Path) -> str:
    """``MLFLOW_TRACKING_URI`` when the user set one, else a file store in
    ``run_dir/mlruns`` (``mlflow ui --backend-store-uri file:RUN_DIR/mlruns``)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()


class MlflowTracker:
    """An MLflow run named after the run directory in the experiment ``project``, through
    MLflow's client API (no global active run, so several loggers may live in one process);
    the config is stored as the run's ``config.json`` artifact. MLflow 3 keeps its file store
    "in maintenance mode" behind ``MLFLOW_ALLOW_FILE_STORE``: TurnRL's default sets it (unless
    the user did) because a file store needs no database server or migrations."""

    def __init__(self, run_dir: Path, project: str, config: dict | None) -> None:
        _require("mlflow", "mlflow")
        from mlflow import MlflowClient

        uri = mlflow_uri(run_dir)
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(project))
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        if config is not None:
            self.client.log_dict(self.run_id, config, "config.json")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), float(v), now, step) for k, v in scalars.items()]
        for at in range(0, len(metrics), 1000):  # MLflow's cap on one batch
            self.client.log_batch(self.run_id, metrics=metrics[at:at + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """MLflow names allow letters, digits, ``_ - . / :`` and spaces; anything else (``@``
    in pass@k) becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-./: " else "_" for c in key)


def open_tracker(name: str, run_dir: Path, project: str, config: dict | None) -> Tracker:
    """The tracker ``name`` (one of ``turnrl.config.core.TRACKERS``) for ``run_dir``; a
    missing library fails in one line naming the ``tracking`` extra."""
    if name == "tensorboard":
        return TensorBoardTracker(run_dir)
    makers = {"wandb": WandbTracker, "trackio": TrackioTracker, "mlflow": MlflowTracker}
    if name not in makers:
        raise ConfigError(f"run.tracking: unknown tracker '{name}'; choose from tensorboard, "
                          "wandb, trackio, mlflow")
    return makers[name](run_dir, project, config)
