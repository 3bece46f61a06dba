"""Trackio and MLflow (and the missing-library error): what a run logs is read back from
each tracker's own local store through its own API."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from turnrl.config import ConfigError, load_config
from turnrl.metrics import MetricsLogger, read_metrics
from turnrl.prometheus import CONTENT_TYPE
from turnrl.trainer import train

TRACKIO_RUN = """
import json, sys
from turnrl.metrics import MetricsLogger
from trackio.sqlite_storage import SQLiteStorage
with MetricsLogger(sys.argv[1], tracking=["trackio"], config={"algo": {"lr": 1e-5}}) as log:
    log.log(1, {"collapse/mi": 0.25, "reward/mean": 1.0, "note": "text"})
    log.log(2, {"collapse/mi": 0.125, "reward/mean": 0.5})
name = sys.argv[1].rstrip("/").rsplit("/", 1)[-1]
print(json.dumps([SQLiteStorage.get_logs("turnrl", name),
                  SQLiteStorage.get_run_config("turnrl", name)]))
"""


def mlflow_history(run_dir: Path, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("turnrl")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]


def test_mlflow_stores_every_step_in_a_file_store_under_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run-a"
    with MetricsLogger(run_dir, tracking=["mlflow"], config={"algo": {"lr": 1e-5}}) as logger:
        logger.log(1, {"collapse/mi": 0.25, "eval/pass@4": 0.5, "note": "text"})
        logger.log(2, {"collapse/mi": 0.125})
    assert mlflow_history(run_dir, "collapse/mi") == [(1, 0.25), (2, 0.125)]
    assert mlflow_history(run_dir, "eval/pass_4") == [(1, 0.5)]  # '@' is not an MLflow name
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("turnrl").experiment_id])
    config = Path(client.download_artifacts(run.info.run_id, "config.json", str(tmp_path)))
    assert json.loads(config.read_text()) == {"algo": {"lr": 1e-5}}
    assert read_metrics(run_dir)[0]["collapse/mi"] == 0.25  # metrics.jsonl as ever


def test_a_missing_tracker_fails_in_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    with pytest.raises(ConfigError) as err:
        MetricsLogger(tmp_path, tracking=["mlflow"])
    assert str(err.value) == ("run.tracking names mlflow but mlflow cannot be imported (not "
                              "installed): pip install 'turnrl[tracking]'")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_run_tracking_names_are_checked():
    assert load_config(None, ["--run.tracking", "MLflow, trackio,mlflow"]).run.trackers() == [
        "mlflow", "trackio"]
    with pytest.raises(ConfigError, match="run.tracking: unknown tracker neptune; choose from "
                                          "trackio, mlflow, tensorboard, wandb, prometheus"):
        load_config(None, ["--run.tracking", "trackio,neptune"])


def test_trackio_stores_every_step_in_its_local_store(tmp_path):
    # A process of its own: trackio reads TRACKIO_DIR once, when it is imported.
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    for key in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", TRACKIO_RUN, str(tmp_path / "run-t")],
                         check=True, capture_output=True, text=True, timeout=120, env=env)
    logs, config = json.loads(next(line for line in out.stdout.splitlines()
                                   if line.startswith("[[")))
    assert out.stdout.count("Run finished") == 1  # closed once, not again at exit
    assert [(log["step"], log["collapse/mi"], log["reward/mean"]) for log in logs] == [
        (1, 0.25, 1.0), (2, 0.125, 0.5)]
    assert config["algo"] == {"lr": 1e-5}
    assert (tmp_path / "trackio" / "turnrl.db").is_file()  # local: no Space, no server


def test_a_training_run_logs_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run-m"
    train(load_config(None, ["--model.name", "tiny", "--env.name", "guess-number",
                             "--run.steps", "2", "--eval.episodes", "0",
                             "--rollout.group_size", "2", "--rollout.groups_per_step", "2",
                             "--rollout.max_new_tokens", "4", "--rollout.max_turns", "2",
                             "--run.progress", "false", "--run.tensorboard", "false",
                             "--run.tracking", "mlflow", "--run.collapse_every", "1",
                             "--run.out_dir", str(run_dir)]))
    jsonl = read_metrics(run_dir)
    for key in ("collapse/mi", "reward/mean", "time/update_s"):
        assert mlflow_history(run_dir, key) == [(r["step"], r[key]) for r in jsonl]


def test_prometheus_serves_the_latest_step_while_the_logger_is_open(tmp_path, capsys):
    with MetricsLogger(tmp_path, tracking=["prometheus"]) as logger:
        url = capsys.readouterr().out.strip().split()[-1]  # metrics: http://127.0.0.1:N/...
        logger.log(1, {"collapse/mi": 0.5, "reward/mean": 0.25})
        logger.log(2, {"collapse/mi": 0.125, "eval/pass@4": 1.0, "note": "text"})
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.headers["content-type"] == CONTENT_TYPE
            page = response.read().decode()
        health = json.loads(urllib.request.urlopen(url.replace("/metrics", "/health"),
                                                   timeout=10).read())
    values = {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples}
    assert values["turnrl_step"] == 2 and values["turnrl_collapse_mi"] == 0.125
    assert values["turnrl_reward_mean"] == 0.25 and values["turnrl_eval_pass_4"] == 1.0
    assert "turnrl_note" not in values  # text is no gauge
    assert health["status"] == "ok" and health["step"] == 2
    with pytest.raises(urllib.error.URLError):  # closed with the logger
        urllib.request.urlopen(url, timeout=5)


@pytest.mark.slow
def test_a_training_run_serves_its_metrics_and_health_while_it_trains(tmp_path):
    """``turnrl train --run.tracking prometheus`` as a user runs it: the printed URL answers
    with the run's numbers while it trains (scraped until a step shows, then stopped)."""
    log = tmp_path / "out.txt"
    with log.open("w") as out:  # a file, not a pipe: nothing to drain, never blocks the run
        run = subprocess.Popen(
            [sys.executable, "-m", "turnrl", "train", "--model.name", "tiny", "--run.steps",
             "500", "--rollout.max_new_tokens", "3", "--rollout.max_turns", "1",
             "--eval.episodes", "2", "--run.progress", "false", "--run.tensorboard", "false",
             "--run.checkpoint_every", "0", "--run.tracking", "prometheus",
             "--run.out_dir", str(tmp_path / "run")], stdout=out, stderr=subprocess.STDOUT)
    deadline, url, values = time.monotonic() + 300, "", {}
    try:
        while not url:  # the line the tracker prints when it listens
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            url = next((line.split()[-1] for line in log.read_text().splitlines()
                        if line.startswith("metrics: ")), "")
            time.sleep(0.1)
        while values.get("turnrl_step", 0) < 1:  # the first step's numbers, once logged
            assert run.poll() is None and time.monotonic() < deadline, "no step was served"
            page = urllib.request.urlopen(url, timeout=10).read().decode()
            values = {s.name: s.value for f in text_string_to_metric_families(page)
                      for s in f.samples}
        health = json.loads(urllib.request.urlopen(url.replace("/metrics", "/health"),
                                                   timeout=10).read())
    finally:
        run.kill()
        run.wait(timeout=60)
    assert "turnrl_reward_mean" in values and "turnrl_time_update_s" in values, sorted(values)
    assert health["status"] == "ok" and health["step"] >= values["turnrl_step"]
    logged = {r["step"]: r for r in read_metrics(tmp_path / "run")}
    assert values["turnrl_reward_mean"] == logged[int(values["turnrl_step"])]["reward/mean"]
