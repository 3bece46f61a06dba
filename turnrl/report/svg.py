"""Line charts as inline SVG strings: no plotting library, no script, viewable offline.

Every text that reaches the markup goes through ``html.escape`` (metric and run names come
from files a user or an environment wrote). The axis maths takes any finite numbers: one
point, a constant curve (float noise included), zeros, negatives, magnitudes up to the largest
float (spreads under 1e-290 are drawn flat); NaN and inf are left out of a chart, and the page
puts :func:`empty_chart` ("no data") where a logged metric has no finite value.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from html import escape

from turnrl.report.data import finite

WIDTH, HEIGHT = 420, 240
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 28, 34
DIGIT_PX = 6.5
"""About the width of one character of an 11px tick label: long labels widen the margin."""
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2")
FLAT = 1e-9
"""Relative spread under which a curve is drawn as constant (float noise, not a trend)."""
DUST = 1e-290
"""Absolute spread (and size) under which numbers are drawn as zero: near the subnormals,
halving a span (to keep it from overflowing) would round it to nothing."""
_BIGGEST = sys.float_info.max


@dataclass
class Series:
    """One run's curve: (x, y) points, and optional (x, y, lo, hi) points with intervals.

    Entries may be anything a metrics file holds: :func:`drawable` keeps the finite numbers.
    """

    name: str
    color: str
    points: list[tuple[float, float]] = field(default_factory=list)
    intervals: list[tuple[float, float, float, float]] = field(default_factory=list)


def drawable(series: Series) -> Series:
    """``series`` without its non-finite points, sorted by x; an interval's missing or
    non-finite end becomes its point's value."""
    points = sorted((x, y) for x, y in ((finite(a), finite(b)) for a, b in series.points)
                    if x is not None and y is not None)
    intervals = []
    for x, y, lo, hi in series.intervals:
        x, y = finite(x), finite(y)
        if x is not None and y is not None:
            lo_, hi_ = finite(lo), finite(hi)
            intervals.append((x, y, y if lo_ is None else lo_, y if hi_ is None else hi_))
    return Series(series.name, series.color, points, sorted(intervals))


def _padded(lo: float, hi: float) -> tuple[float, float]:
    """[lo, hi] widened around a constant (or float-noise) range so it has a height."""
    if hi - lo > max(FLAT * max(abs(lo), abs(hi)), DUST):
        return lo, hi
    middle = lo / 2 + hi / 2
    pad = abs(middle) / 10 if abs(middle) > DUST else 0.5  # 10% of the value; +-0.5 near 0
    return max(middle - pad, -_BIGGEST), min(middle + pad, _BIGGEST)


def nice_ticks(lo: float, hi: float, count: int = 5, min_step: float = 0.0) -> list[float]:
    """Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten.

    Any finite ``lo <= hi`` gives at least two finite, increasing ticks; a constant range is
    widened first (:func:`_padded`). Where rounding outward would pass the largest float
    (spans near 1e308), the ticks are the range's own ends.
    """
    lo, hi = _padded(lo, hi)
    raw = max((hi / 2 - lo / 2) * 2 / max(1, count - 1), min_step)  # halves: no overflow
    if not math.isfinite(raw) or raw * 10 > _BIGGEST:
        return [lo, hi]
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step)
    ticks = [(first + i) * step for i in range(math.ceil(hi / step - first) + 1)]
    if ticks[-1] < hi:  # float rounding of the last multiple
        ticks.append(ticks[-1] + step)
    return ticks if all(map(math.isfinite, ticks)) and len(ticks) <= 4 * count else [lo, hi]


def tick_labels(ticks: list[float]) -> list[str]:
    """Labels with as many digits as the spacing needs, so neighbouring ticks never read
    alike: fixed decimals for everyday magnitudes, significant digits (2.5e-12, 1e+20) past
    them."""
    spacing = min((b / 2 - a / 2) * 2 for a, b in zip(ticks, ticks[1:], strict=False)) \
        if len(ticks) > 1 else 0.0
    largest = max(abs(t) for t in ticks)
    if not (math.isfinite(spacing) and spacing > 0):
        return [f"{t + 0.0:.3g}" for t in ticks]
    decimals = -math.floor(math.log10(spacing))
    if spacing >= 1e-4 and largest < 1e6:
        return [f"{t + 0.0:.{max(0, decimals)}f}" for t in ticks]
    digits = min(17, max(1, math.floor(math.log10(largest)) + decimals + 1))
    return [f"{t + 0.0:.{digits}g}" for t in ticks]


def _fraction(value: float, lo: float, hi: float) -> float:
    """Where ``value`` sits between ``lo`` and ``hi`` (0 to 1), in halves so that spans up
    to twice the largest float do not overflow."""
    return (value / 2 - lo / 2) / (hi / 2 - lo / 2) if hi > lo else 0.5


def _label(value: float) -> str:
    return f"{value:.4g}"


def _open(title: str, css_class: str = "chart") -> list[str]:
    return [f'<svg class="{css_class}" data-metric="{escape(title)}" viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'width="{WIDTH}" height="{HEIGHT}" role="img" xmlns="http://www.w3.org/2000/svg">',
            f'<title>{escape(title)}</title>',
            f'<text class="title" x="{LEFT}" y="18">{escape(title)}</text>']


def empty_chart(title: str, reason: str) -> str:
    """The place of a chart that has nothing to draw: its title and "no data: ``reason``"."""
    return "".join(_open(title, "chart nodata")) + (
        f'<text class="nodata" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">'
        f"no data: {escape(reason)}</text></svg>")


def line_chart(title: str, series: list[Series]) -> str:
    """An SVG chart of ``series`` sharing axes; '' when no series has a finite point.

    NaN and inf points are left out; a series left without points gets no line.
    """
    series = [s for s in map(drawable, series) if s.points or s.intervals]
    xs = [x for s in series for x, _ in s.points] + [x for s in series for x, *_ in s.intervals]
    ys = [y for s in series for _, y in s.points] + \
        [v for s in series for _, *rest in s.intervals for v in rest]
    if not xs:
        return ""
    y_ticks = nice_ticks(min(ys), max(ys))
    x_ticks = nice_ticks(min(xs), max(xs), count=6, min_step=1.0)  # steps are whole
    y_labels = tick_labels(y_ticks)
    left = max(LEFT, 10 + DIGIT_PX * max(map(len, y_labels)))  # room for 5.855185, 1e+300

    def px(x: float) -> float:
        return left + _fraction(x, x_ticks[0], x_ticks[-1]) * (WIDTH - left - RIGHT)

    def py(y: float) -> float:
        return HEIGHT - BOTTOM - _fraction(y, y_ticks[0], y_ticks[-1]) * (HEIGHT - TOP - BOTTOM)

    out = _open(title)
    for t, label in zip(y_ticks, y_labels, strict=True):
        out.append(f'<line class="grid" x1="{left}" x2="{WIDTH - RIGHT}" y1="{py(t):.1f}" '
                   f'y2="{py(t):.1f}"/><text class="tick" x="{left - 6}" y="{py(t) + 4:.1f}" '
                   f'text-anchor="end">{label}</text>')
    for t, label in zip(x_ticks, tick_labels(x_ticks), strict=True):
        out.append(f'<text class="tick" x="{px(t):.1f}" y="{HEIGHT - BOTTOM + 16}" '
                   f'text-anchor="middle">{label}</text>')
    out.append(f'<text class="tick" x="{(left + WIDTH - RIGHT) / 2}" y="{HEIGHT - 4}" '
               'text-anchor="middle">step</text>')
    for s in series:
        color, name = escape(s.color), escape(s.name)
        if s.points:
            d = " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(y):.1f}"
                         for i, (x, y) in enumerate(s.points))
            out.append(f'<path class="line" d="{d}" stroke="{color}" fill="none" '
                       f'data-points="{len(s.points)}"><title>{name}</title></path>')
            # markers with a hover readout while they stay legible (a lone point is only one)
            if len(s.points) <= 60:
                out += [f'<circle class="mark" cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" '
                        f'fill="{color}"><title>{name}: step {_label(x)}, {_label(y)}</title>'
                        "</circle>" for x, y in s.points]
        for x, y, lo, hi in s.intervals:
            out.append(f'<g class="interval"><line x1="{px(x):.1f}" x2="{px(x):.1f}" '
                       f'y1="{py(lo):.1f}" y2="{py(hi):.1f}" stroke="{color}"/>'
                       f'<rect class="mark" x="{px(x) - 3:.1f}" y="{py(y) - 3:.1f}" width="6" '
                       f'height="6" fill="{color}"><title>{name} held-out: step {_label(x)}, '
                       f'{_label(y)} [{_label(lo)}, {_label(hi)}]</title></rect></g>')
    if len(series) > 1:
        for i, s in enumerate(series):
            out.append(f'<text class="legend" x="{WIDTH - RIGHT}" y="{TOP + 12 * i + 4}" '
                       f'text-anchor="end" fill="{escape(s.color)}">{escape(s.name)}</text>')
    out.append("</svg>")
    return "".join(out)
