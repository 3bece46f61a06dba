"""Line charts as inline SVG strings: no plotting library, no script, viewable offline.

Every text that reaches the markup goes through ``html.escape`` (metric and run names come
from files a user or an environment wrote).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

WIDTH, HEIGHT = 420, 240
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 28, 34
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2")


@dataclass
class Series:
    """One run's curve: (x, y) points, and optional (x, y, lo, hi) points with intervals."""

    name: str
    color: str
    points: list[tuple[float, float]] = field(default_factory=list)
    intervals: list[tuple[float, float, float, float]] = field(default_factory=list)


def nice_ticks(lo: float, hi: float, count: int = 5, min_step: float = 0.0) -> list[float]:
    """Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten."""
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    raw = max((hi - lo) / max(1, count - 1), min_step)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    return [first + i * step for i in range(int(math.ceil((hi - first) / step)) + 1)]


def _label(value: float) -> str:
    return f"{value:.4g}"


def _tick_label(value: float, ticks: list[float]) -> str:
    """As many decimals as the tick spacing needs, so neighbouring ticks never read alike."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    return f"{value:.{max(0, -math.floor(math.log10(step)))}f}"


def line_chart(title: str, series: list[Series]) -> str:
    """An SVG chart of ``series`` sharing axes; '' when no series has a point."""
    xs = [x for s in series for x, _ in s.points] + [x for s in series for x, *_ in s.intervals]
    ys = [y for s in series for _, y in s.points] + \
        [v for s in series for _, *rest in s.intervals for v in rest]
    if not xs:
        return ""
    y_ticks = nice_ticks(min(ys), max(ys))
    x_ticks = nice_ticks(min(xs), max(xs), count=6, min_step=1.0)  # steps are whole
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]

    def px(x: float) -> float:
        return LEFT + (x - x0) / ((x1 - x0) or 1) * (WIDTH - LEFT - RIGHT)

    def py(y: float) -> float:
        return HEIGHT - BOTTOM - (y - y0) / ((y1 - y0) or 1) * (HEIGHT - TOP - BOTTOM)

    out = [f'<svg class="chart" data-metric="{escape(title)}" viewBox="0 0 {WIDTH} {HEIGHT}" '
           f'width="{WIDTH}" height="{HEIGHT}" role="img" xmlns="http://www.w3.org/2000/svg">',
           f'<title>{escape(title)}</title>',
           f'<text class="title" x="{LEFT}" y="18">{escape(title)}</text>']
    for t in y_ticks:
        out.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py(t):.1f}" '
                   f'y2="{py(t):.1f}"/><text class="tick" x="{LEFT - 6}" y="{py(t) + 4:.1f}" '
                   f'text-anchor="end">{_tick_label(t, y_ticks)}</text>')
    for t in x_ticks:
        out.append(f'<text class="tick" x="{px(t):.1f}" y="{HEIGHT - BOTTOM + 16}" '
                   f'text-anchor="middle">{_tick_label(t, x_ticks)}</text>')
    out.append(f'<text class="tick" x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 4}" '
               'text-anchor="middle">step</text>')
    for s in series:
        color, name = escape(s.color), escape(s.name)
        if s.points:
            d = " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(y):.1f}"
                         for i, (x, y) in enumerate(s.points))
            out.append(f'<path class="line" d="{d}" stroke="{color}" fill="none" '
                       f'data-points="{len(s.points)}"><title>{name}</title></path>')
            if len(s.points) <= 60:  # markers with a hover readout, while they stay legible
                out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}">'
                        f'<title>{name}: step {_label(x)}, {_label(y)}</title></circle>'
                        for x, y in s.points]
        for x, y, lo, hi in s.intervals:
            out.append(f'<g class="interval"><line x1="{px(x):.1f}" x2="{px(x):.1f}" '
                       f'y1="{py(lo):.1f}" y2="{py(hi):.1f}" stroke="{color}"/>'
                       f'<rect x="{px(x) - 3:.1f}" y="{py(y) - 3:.1f}" width="6" height="6" '
                       f'fill="{color}"><title>{name} held-out: step {_label(x)}, '
                       f'{_label(y)} [{_label(lo)}, {_label(hi)}]</title></rect></g>')
    if len(series) > 1:
        for i, s in enumerate(series):
            out.append(f'<text class="legend" x="{WIDTH - RIGHT}" y="{TOP + 12 * i + 4}" '
                       f'text-anchor="end" fill="{escape(s.color)}">{escape(s.name)}</text>')
    out.append("</svg>")
    return "".join(out)
