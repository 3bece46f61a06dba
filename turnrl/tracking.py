"""Experiment trackers that mirror ``metrics.jsonl``: TensorBoard, W&B, Trackio, MLflow, and a
Prometheus ``/metrics`` of the run's latest numbers.

Each tracker is a small object with ``log(step, scalars)`` and ``close()``; ``MetricsLogger``
(``metrics.py``) writes its durable line first, then hands the same numbers to each. All of
them work offline: TensorBoard writes event files under the run directory, W&B as its own
settings say (``WANDB_MODE=offline`` keeps it local), Trackio into its local SQLite store
(``TRACKIO_DIR``, by default ``~/.cache/huggingface/trackio``; no Space unless the user's
environment names one), MLflow into a file store under the run directory unless
``MLFLOW_TRACKING_URI`` names another. docs/monitoring.md says how to read each back.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from turnrl.config.types import ConfigError
from turnrl.prometheus import CONTENT_TYPE, Family, exposition, metric_name

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


class PrometheusTracker:
    """``GET /metrics`` (Prometheus text: each logged number as a gauge named after its key,
    ``reward/mean`` -> ``turnrl_reward_mean``, and ``turnrl_step``) and ``GET /health``
    on ``127.0.0.1:port`` (0: a free port, printed), served from a thread of the learner's
    process while the run lasts. Loopback only, as it needs no key; needs no library."""

    def __init__(self, port: int = 0) -> None:
        from http.server import ThreadingHTTPServer

        self.latest: dict[str, float] = {}
        self.step, self.logged_at, self.started = 0, 0.0, time.time()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                       name="turnrl-metrics")
        self.thread.start()
        print(f"metrics: http://127.0.0.1:{self.port}/metrics", flush=True)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        with self.lock:
            self.latest.update(scalars)
            self.step, self.logged_at = step, time.time()

    def page(self) -> str:
        """The exposition of the latest value of every key logged so far."""
        with self.lock:
            latest, step, logged_at = dict(self.latest), self.step, self.logged_at
        families: dict[str, Family] = {
            "turnrl_step": ("turnrl_step", "gauge", "steps logged", [({}, float(step))]),
            "turnrl_last_log_timestamp_seconds": (
                "turnrl_last_log_timestamp_seconds", "gauge", "Unix time of the latest step's "
                "log (0: none yet)", [({}, logged_at)])}
        for key, value in latest.items():  # two keys one name apart: the first kept
            families.setdefault(metric_name(key), (metric_name(key), "gauge",
                                                   f"{key}, latest step", [({}, value)]))
        return exposition(families.values())

    def health(self) -> dict:
        return {"status": "ok", "step": self.step,
                "uptime_s": round(time.time() - self.started, 3)}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(tracker: PrometheusTracker) -> type:
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            if self.path == "/metrics":
                body, kind, status = tracker.page().encode(), CONTENT_TYPE, 200
            elif self.path == "/health":
                body, kind, status = json.dumps(tracker.health()).encode(), \
                    "application/json", 200
            else:
                body, kind, status = b"GET /metrics or /health\n", "text/plain", 404
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # a scrape every few seconds: no log lines
            pass

    return Handler


def open_tracker(name: str, run_dir: Path, project: str, config: dict | None,
                 port: int = 0) -> Tracker:
    """The tracker ``name`` (one of ``turnrl.config.core.TRACKERS``) for ``run_dir``; a
    missing library fails in one line naming the ``tracking`` extra. ``port``: the
    prometheus tracker's."""
    if name == "tensorboard":
        return TensorBoardTracker(run_dir)
    if name == "prometheus":
        return PrometheusTracker(port)
    makers = {"wandb": WandbTracker, "trackio": TrackioTracker, "mlflow": MlflowTracker}
    if name not in makers:
        raise ConfigError(f"run.tracking: unknown tracker '{name}'; choose from tensorboard, "
                          "wandb, trackio, mlflow, prometheus")
    return makers[name](run_dir, project, config)
