"""A run's held-out rows (turnrl/trainer/evaluation.py): each names the weight version it
evaluated; the base model's row of an async schedule (``base_row``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from turnrl.config import load_config
from turnrl.evaluation import EvalResult
from turnrl.metrics import MetricsLogger, read_metrics
from turnrl.trainer import LocalSource, learn
from turnrl.trainer.evaluation import base_row, eval_metrics

TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "2",
        "--rollout.max_turns", "1", "--rollout.group_size", "2", "--rollout.groups_per_step",
        "2", "--run.progress", "false", "--run.tensorboard", "false",
        "--run.checkpoint_every", "0"]


def test_eval_metrics_carry_the_interval_and_the_version():
    result = EvalResult(episodes=10, successes=3, mean_reward=0.3, mean_turns=1.0, failed=0)
    row = eval_metrics(result, 7)
    lo, hi = result.interval
    assert row == {"eval/success": 0.3, "eval/success_lo": lo, "eval/success_hi": hi,
                   "eval/reward": 0.3, "eval/version": 7.0}
    assert 0 < lo < 0.3 < hi < 1


def test_the_base_row_is_version_zero_only_with_a_schedule_and_only_once(tmp_path):
    before = EvalResult(episodes=4, successes=1, mean_reward=0.25, mean_turns=1.0, failed=0)

    def run(every: int, start_step: int):
        return SimpleNamespace(cfg=load_config(None, TINY + ["--eval.every", str(every)]),
                               start_step=start_step, run_dir=tmp_path)

    assert base_row(run(2, 0), before) == eval_metrics(before, 0)
    assert base_row(run(0, 0), before) == {}  # no schedule: eval_before.json alone
    assert base_row(run(2, 3), before) == {}  # resumed: the row is in metrics.jsonl already
    assert base_row(run(2, 0), None) == {}  # eval.episodes 0
    with MetricsLogger(tmp_path) as logger:  # resumed before the first checkpoint
        logger.log(0, base_row(run(2, 0), before))
    assert base_row(run(2, 0), before) == {}


@pytest.mark.slow
def test_a_sync_runs_periodic_rows_name_the_version_and_it_logs_no_base_row(tmp_path):
    """Lock-step: version ``step + 1`` is evaluated after step ``step``; no step-0 row (the
    base model's row is the async schedule's, ``RolloutSource.versioned_eval``)."""
    learn(load_config(None, TINY + ["--run.steps", "4", "--eval.every", "2",
                                    "--eval.episodes", "2", "--run.out_dir", str(tmp_path)]),
          LocalSource())
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [(r["step"], r["eval/version"]) for r in rows if "eval/version" in r] == [(2, 2)]
    assert rows[1]["eval/learner_s"] > 0
