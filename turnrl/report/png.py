"""Learning-curve report: one PNG summarising a run's ``metrics.jsonl``.

Uses matplotlib's object API with the Agg canvas directly (no pyplot), so it needs no display
and does not change the global backend of a process that also plots interactively. The axes
take their ticks from :mod:`turnrl.report.svg` (as the HTML page does), so a constant curve,
one point or values near the largest float draw too (matplotlib's own locator fails on
spans past 1e308); NaN and inf are left out and a metric with no finite value says "no data".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from turnrl.report.data import finite, read_run_metrics, require_run_dir
from turnrl.report.svg import nice_ticks, tick_labels

__all__ = ["PREFERRED_METRICS", "curves_figure", "write_report"]

PREFERRED_METRICS = (
    "reward/mean",
    "success/rate",
    "loss/policy",
    "sft/loss",
    "eval/loss",
    "kl",
    "entropy",
    "collapse/mi",
    "episode/turns",
    "episode/tokens",
    "time/step_s",
)
_EVAL = "eval/success"
_NCOLS = 3


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """The finite (step, value) points of ``key``, by step."""
    points = sorted((finite(r["step"]), v) for r in records
                    if (v := finite(r.get(key))) is not None)
    return [s for s, _ in points], [v for _, v in points]


def _rolling_mean(values: list[float], window: int) -> list[float]:
    # Sums of value / window: a window of values near the largest float does not overflow.
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v / window
        if i >= window:
            total -= values[i - window] / window
        out.append(total * (window / min(i + 1, window)))
    return out


def _unit(values: list[float]) -> float:
    """A power of two bringing values past 1e100 under 4, else 1: matplotlib's transforms
    overflow on spans past the largest float, and a power of two scales exactly. The unit
    stays a normal float (2**-1022 at least): where torch has set flush-to-zero, a
    subnormal one would be 0."""
    biggest = max(map(abs, values))
    return 2.0 ** (2 - math.frexp(biggest)[1]) if biggest > 1e100 else 1.0


def _scaled(values: list[float], unit: float) -> list[float]:
    return [v * unit for v in values]


def _set_axes(ax: Any, xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Limits and labelled ticks from the page's tick maths (steps are whole numbers); the
    units (:func:`_unit`) to plot x and y in, with the labels in the values' own units."""
    units = _unit(xs), _unit(ys)
    for ticks, unit, set_lim, set_ticks in (
            (nice_ticks(min(xs), max(xs), count=6, min_step=1.0), units[0], ax.set_xlim,
             ax.set_xticks),
            (nice_ticks(min(ys), max(ys)), units[1], ax.set_ylim, ax.set_yticks)):
        set_lim(ticks[0] * unit, ticks[-1] * unit)
        set_ticks(_scaled(ticks, unit), labels=tick_labels(ticks))
    return units


def _plot_curve(ax: Any, steps: list[float], values: list[float], key: str) -> None:
    x_unit, y_unit = _set_axes(ax, steps, values)
    steps, values = _scaled(steps, x_unit), _scaled(values, y_unit)
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
    steps, values, lows, highs = [], [], [], []
    for r in sorted(records, key=lambda r: finite(r["step"])):
        value = finite(r.get(_EVAL))
        if value is None:
            continue
        lo, hi = finite(r.get(f"{_EVAL}_lo")), finite(r.get(f"{_EVAL}_hi"))
        steps.append(finite(r["step"]))
        values.append(value)
        # A point without an interval gets a zero-length bar rather than being dropped.
        lows.append(value if lo is None else min(lo, value))
        highs.append(value if hi is None else max(hi, value))
    x_unit, y_unit = _set_axes(ax, steps, lows + highs)
    values, lows, highs = (_scaled(v, y_unit) for v in (values, lows, highs))
    below = [v - lo for v, lo in zip(values, lows, strict=True)]
    above = [hi - v for v, hi in zip(values, highs, strict=True)]
    ax.errorbar(_scaled(steps, x_unit), values, yerr=[below, above], fmt="o-", color="C1",
                capsize=4)
    ax.set_title(f"{_EVAL} (with CI)" if any(below) or any(above) else _EVAL)


def _panels(records: list[dict[str, Any]]) -> list[str]:
    """The metrics logged at all (a panel each; one never finite says "no data")."""
    return [k for k in (*PREFERRED_METRICS, _EVAL) if any(k in r for r in records)]


def _plot_panel(ax: Any, records: list[dict[str, Any]], key: str) -> None:
    steps, values = _series(records, key)
    if not steps:
        ax.text(0.5, 0.5, "no data: never a finite number", ha="center", va="center",
                transform=ax.transAxes, color="0.5")
        ax.set_title(key)
    elif key == _EVAL:
        _plot_eval(ax, records)
    else:
        _plot_curve(ax, steps, values, key)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the learning curves of ``run_dir/metrics.jsonl`` into a PNG and return its path.

    The default output is ``run_dir/report.png``. A run with no plottable metrics yet (or
    no ``metrics.jsonl``: stopped before its first step) still gets a PNG, saying so, rather
    than an error; unreadable lines of ``metrics.jsonl`` are left out.
    """
    run_dir = require_run_dir(run_dir)
    out_path = Path(out) if out is not None else run_dir / "report.png"
    records = read_run_metrics(run_dir).records

    out_path.parent.mkdir(parents=True, exist_ok=True)
    curves_figure(records, run_dir.resolve().name).savefig(out_path, format="png", dpi=100)
    return out_path


def curves_figure(records: list[dict[str, Any]], name: str) -> Figure:
    """The figure of ``write_report``: a panel per metric of ``records`` that it draws."""
    panels = _panels(records)
    ncols = min(_NCOLS, max(1, len(panels)))
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig = Figure(figsize=(4.5 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"TurnRL run: {name}")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, key in zip(axes, panels, strict=False):
        _plot_panel(ax, records, key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_axis_off()
    if not panels:
        axes[0].text(0.5, 0.5, "no metrics logged yet", ha="center", va="center")
    return fig
