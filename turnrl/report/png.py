"""Learning-curve report: one PNG summarising a run's ``metrics.jsonl``.

Uses matplotlib's object API with the Agg canvas directly (no pyplot), so it needs no display
and does not change the global backend of a process that also plots interactively.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from turnrl.metrics import read_metrics

__all__ = ["PREFERRED_METRICS", "write_report"]

PREFERRED_METRICS = (
    "reward/mean",
    "success/rate",
    "loss/policy",
    "sft/loss",
    "eval/loss",
    "kl",
    "entropy",
    "episode/turns",
    "episode/tokens",
    "time/step_s",
)
_EVAL = "eval/success"
_NCOLS = 3


def _number(value: Any) -> float | None:
    """A finite float, or None for missing, null (NaN when logged), or non-numeric values."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], _number(r.get(key))) for r in records]
    points = [(s, v) for s, v in points if v is not None]
    return [s for s, _ in points], [v for _, v in points]


def _rolling_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _plot_curve(ax: Any, steps: list[float], values: list[float], key: str) -> None:
    # Per-step RL metrics are noisy: show the raw curve faintly under a smoothed one.
    if len(values) >= 20:
        ax.plot(steps, values, color="C0", alpha=0.3, linewidth=1)
        window = max(2, len(values) // 20)
        ax.plot(
            steps,
            _rolling_mean(values, window),
            color="C0",
            linewidth=1.8,
            label=f"mean of {window}",
        )
        ax.legend(fontsize="small")
    else:
        ax.plot(steps, values, color="C0", marker="o", markersize=3)
    ax.set_title(key)


def _plot_eval(ax: Any, records: list[dict[str, Any]]) -> None:
    steps, values, below, above = [], [], [], []
    for r in records:
        value = _number(r.get(_EVAL))
        if value is None:
            continue
        lo, hi = _number(r.get(f"{_EVAL}_lo")), _number(r.get(f"{_EVAL}_hi"))
        steps.append(r["step"])
        values.append(value)
        # A point without an interval gets a zero-length bar rather than being dropped.
        below.append(max(0.0, value - lo) if lo is not None else 0.0)
        above.append(max(0.0, hi - value) if hi is not None else 0.0)
    ax.errorbar(steps, values, yerr=[below, above], fmt="o-", color="C1", capsize=4)
    ax.set_title(f"{_EVAL} (with CI)" if any(below) or any(above) else _EVAL)


def _panels(records: list[dict[str, Any]]) -> list[str]:
    present = [k for k in PREFERRED_METRICS if _series(records, k)[0]]
    if any(_number(r.get(_EVAL)) is not None for r in records):
        present.append(_EVAL)
    return present


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the learning curves of ``run_dir/metrics.jsonl`` into a PNG and return its path.

    The default output is ``run_dir/report.png``. A run with no plottable metrics yet still
    gets a PNG, saying so, rather than an error.
    """
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}; is this a TurnRL run directory?")
    out_path = Path(out) if out is not None else run_dir / "report.png"
    records = read_metrics(metrics_path)
    panels = _panels(records)

    ncols = min(_NCOLS, max(1, len(panels)))
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig = Figure(figsize=(4.5 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"TurnRL run: {run_dir.resolve().name}")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, key in zip(axes, panels, strict=False):
        if key == _EVAL:
            _plot_eval(ax, records)
        else:
            _plot_curve(ax, *_series(records, key), key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_axis_off()
    if not panels:
        axes[0].text(0.5, 0.5, "no metrics logged yet", ha="center", va="center")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png", dpi=100)
    return out_path
