import io
import json
import math

import pytest
from rich.console import Console

from turnrl.metrics import (
    MetricsLogger,
    TrainProgress,
    print_table,
    read_metrics,
    truncate_metrics,
)


def _lines(run_dir):
    return (run_dir / "metrics.jsonl").read_text().splitlines()


def test_log_writes_one_json_line_per_step(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"reward/mean": 0.5, "episode/turns": 3})
        logger.log(2, {"reward/mean": 0.75})
    lines = _lines(tmp_path)
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["step"] == 1 and first["reward/mean"] == 0.5 and first["episode/turns"] == 3
    assert isinstance(first["time"], float)
    assert list(first)[:2] == ["step", "time"]


def test_logged_line_is_on_disk_before_close(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(7, {"kl": 0.01})
    # Another reader sees it without the logger being closed (flushed and fsync'ed).
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["kl"] == 0.01
    logger.close()
    logger.close()  # idempotent


def test_log_after_close_is_an_error(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.close()
    with pytest.raises(RuntimeError):
        logger.log(1, {"x": 1.0})


def test_non_finite_values_are_written_as_null(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"loss/policy": math.nan, "kl": math.inf, "entropy": 1.5})
    line = _lines(tmp_path)[0]
    assert "NaN" not in line and "Infinity" not in line
    record = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert record["loss/policy"] is None and record["kl"] is None and record["entropy"] == 1.5


def test_tensor_and_numpy_scalars_are_unwrapped(tmp_path):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"a": torch.tensor(0.25), "b": np.float32(0.5), "c": np.int64(4)})
    record = read_metrics(tmp_path)[0]
    assert record["a"] == 0.25 and record["b"] == 0.5 and record["c"] == 4


def test_reserved_keys_are_rejected(tmp_path):
    with MetricsLogger(tmp_path) as logger, pytest.raises(ValueError, match="reserved"):
        logger.log(1, {"step": 3.0})
    assert _lines(tmp_path) == []


def test_torn_last_line_is_skipped(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"x": 1.0})
        logger.log(2, {"x": 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "x": 3.')  # what a kill -9 mid-write leaves
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_metrics(path)


def test_reopening_after_a_torn_line_appends_cleanly(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"x": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "x"')
    with MetricsLogger(tmp_path) as logger:
        logger.log(2, {"x": 2.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert len(_lines(tmp_path)) == 2


def test_truncate_metrics_keeps_steps_up_to_checkpoint(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"x": float(step)})
    path = tmp_path / "metrics.jsonl"
    before = _lines(tmp_path)
    truncate_metrics(path, after_step=3)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert _lines(tmp_path) == before[:3]  # kept lines are byte-identical
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    # Resuming then logs steps 4.. again without duplicates.
    with MetricsLogger(tmp_path) as logger:
        logger.log(4, {"x": 40.0})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]


def test_truncate_metrics_drops_torn_line_and_tolerates_missing_file(tmp_path):
    truncate_metrics(tmp_path / "metrics.jsonl", after_step=10)  # no error
    assert not (tmp_path / "metrics.jsonl").exists()
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "x')
    truncate_metrics(path, after_step=10)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_tracking_backends_missing_warns_and_continues(tmp_path, capsys, monkeypatch):
    import sys

    # Simulate neither package being installed, whatever this machine has.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with MetricsLogger(tmp_path, tensorboard=True, wandb=True, config={"lr": 1e-5}) as logger:
        logger.log(1, {"x": 1.0})
    err = capsys.readouterr().err
    assert err.count("warning") == 2
    assert "tensorboard" in err and "wandb" in err
    assert read_metrics(tmp_path)[0]["x"] == 1.0


def _non_tty_console():
    return Console(file=io.StringIO(), force_terminal=False, width=120)


def test_train_progress_disabled_is_a_no_op():
    console = _non_tty_console()
    with TrainProgress(10, enabled=False, console=console) as progress:
        for step in range(1, 11):
            progress.update(step, reward=0.5, tokens=100)
    assert console.file.getvalue() == ""


def test_train_progress_non_tty_prints_plain_lines():
    console = _non_tty_console()
    with TrainProgress(4, description="grpo", console=console, plain_every=2) as progress:
        for step in range(1, 5):
            progress.update(step, reward=0.25 * step, turns=3, step_s=1.5, kl=0.01)
    out = console.file.getvalue()
    assert "\x1b[" not in out  # no escape codes in a log file
    lines = out.strip().splitlines()
    assert len(lines) == 2  # steps 2 and 4
    assert lines[-1].startswith("grpo step 4/4")
    assert "reward 1" in lines[-1] and "len 3 turns" in lines[-1]
    assert "1.5 s/step" in lines[-1] and "kl=0.01" in lines[-1] and "ETA 0:00:00" in lines[-1]


def test_train_progress_default_console_in_non_tty(capsys):
    # Under pytest stdout is captured, i.e. not a terminal, as in CI.
    with TrainProgress(3) as progress:
        for step in range(1, 4):
            progress.update(step, reward=1.0, length=12)
    assert "step 3/3" in capsys.readouterr().out


def test_train_progress_terminal_renders_bar():
    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    with TrainProgress(5, console=console, start_step=1) as progress:
        for step in range(2, 6):
            progress.update(step, reward=0.5, tokens=42)
    out = console.file.getvalue()
    assert "step 5/5" in out and "reward 0.5" in out and "len 42 tokens" in out


def test_print_table_returns_plain_text():
    console = _non_tty_console()
    text = print_table(
        "before vs after",
        ["model", "success"],
        [["base", "23.4% [15.1, 34.2]"], ["trained", "61.0% [50.2, 70.8]"]],
        console=console,
    )
    for cell in [
        "before vs after",
        "model",
        "success",
        "base",
        "23.4% [15.1, 34.2]",
        "trained",
        "61.0% [50.2, 70.8]",
    ]:
        assert cell in text
    assert "\x1b[" not in text
    assert "trained" in console.file.getvalue()


def test_values_that_are_not_numbers_are_written_as_bounded_text(tmp_path):
    """A metric that is a vector, an object or an object whose str raises never fails the
    step's log line (before: float() raised inside log, and the step was lost)."""
    import torch

    class Weird:
        def __str__(self):
            raise ValueError("no str")

    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"vector": torch.tensor([1.0, 2.0]), "weird": Weird(),
                       "complex": complex(1, 2), "long": "x" * 10_000})
    [record] = read_metrics(tmp_path)
    assert record["vector"].startswith("tensor([1., 2.])")
    assert record["weird"] == "<Weird: str raised ValueError>"
    assert record["complex"] == "(1+2j)" and len(record["long"]) == 10_000
