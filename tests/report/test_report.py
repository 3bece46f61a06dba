import json
import warnings

import pytest

from turnrl.report import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(run_dir, records):
    lines = [json.dumps(r) for r in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_write_report_creates_png(tmp_path):
    records = [
        {
            "step": i,
            "time": 1000.0 + i,
            "reward/mean": 0.1 * i,
            "loss/policy": 1.0 / (i + 1),
            "kl": None if i == 3 else 0.01 * i,
            "episode/turns": 3,
        }
        for i in range(30)
    ]
    # Evaluation points, one without an interval; a record with no metrics at all.
    records += [
        {"step": 0, "eval/success": 0.2, "eval/success_lo": 0.1, "eval/success_hi": 0.35},
        {"step": 29, "eval/success": 0.6},
        {"step": 30},
    ]
    _write_metrics(tmp_path, records)
    out = write_report(tmp_path)
    assert out == tmp_path / "report.png"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 1000


def test_write_report_custom_out_and_torn_line(tmp_path):
    _write_metrics(tmp_path, [{"step": 1, "success/rate": 0.5}])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "success/ra')
    out = write_report(tmp_path, tmp_path / "plots" / "curves.png")
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_write_report_with_no_plottable_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert write_report(tmp_path).read_bytes().startswith(PNG_MAGIC)


def test_write_report_of_what_is_no_run_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl .*in .*TurnRL run directory"):
        write_report(tmp_path)
    with pytest.raises(FileNotFoundError, match="no run directory .*--run.out_dir"):
        write_report(tmp_path / "nowhere")


def test_write_report_of_a_run_stopped_before_its_first_step(tmp_path):
    """`turnrl train` writes config.yaml first; killed then, the run has no metrics.jsonl."""
    (tmp_path / "config.yaml").write_text("run: {steps: 2}\n")
    assert write_report(tmp_path).read_bytes().startswith(PNG_MAGIC)


def _png_size(data: bytes) -> tuple[int, int]:
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_write_report_draws_extreme_and_degenerate_series_without_warnings(tmp_path):
    """A panel per logged metric (one never finite says "no data"); spans past the largest
    float, subnormals, a constant and a lone point draw without matplotlib's overflows."""
    records = [{"step": i, "reward/mean": (-1) ** i * 1.7e308, "kl": 5e-324 * i,
                "entropy": (0.053125, 0.053125000000000006)[i % 2], "loss/policy": float("nan"),
                **({"success/rate": -2.0} if i == 3 else {})} for i in range(1, 7)]
    _write_metrics(tmp_path, records)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = write_report(tmp_path).read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert _png_size(data) == (1350, 640)  # 5 panels: 3 columns, 2 rows of 450 x 320 px
