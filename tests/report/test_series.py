"""Property tests of the report: charts drawn from generated series, reports of generated
run directories. A seeded generator (no extra dependency) makes the classes a real run can
produce: one point, all-equal values, float-noise-equal values, zeros, negatives, NaN and inf,
magnitudes from 5e-324 to 1.7e308, missing metrics, null, text and 400-digit values, records
without a step, torn and corrupt lines, an empty metrics.jsonl, none at all (a run killed
before its first step), eval files cut short or from another version."""

from __future__ import annotations

import json
import math
import random
import re
import sys
import warnings
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from turnrl.cli import main
from turnrl.report import write_html_report, write_report
from turnrl.report.html import CURVES
from turnrl.report.png import PREFERRED_METRICS, curves_figure
from turnrl.report.svg import (
    BOTTOM,
    HEIGHT,
    LEFT,
    RIGHT,
    TOP,
    WIDTH,
    Series,
    line_chart,
    nice_ticks,
    tick_labels,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCALES = (5e-324, 1e-300, 1e-9, 1e-3, 1.0, 7.5, 1e6, 1e20, 1e300, 1.7e308)
SHAPES = ("constant", "zeros", "noise", "offset-noise", "positive", "negative", "mixed-scales",
          "ramp")
JUNK = (math.nan, math.inf, -math.inf, None, "text", True, 10**400, [1], {"a": 1})
SVG = "{http://www.w3.org/2000/svg}"


def random_values(rng: random.Random, n: int, junk: float = 0.0) -> list[Any]:
    """``n`` values of one shape and scale; a share ``junk`` replaced by non-finite or
    non-numeric entries."""
    shape, scale = rng.choice(SHAPES), rng.choice(SCALES)
    sign = rng.choice((-1, 1))
    make = {
        "constant": lambda i: sign * scale,
        "zeros": lambda i: 0.0,
        "noise": lambda i: rng.uniform(-1, 1) * scale,
        "offset-noise": lambda i: sign * scale * (1 + rng.uniform(-4e-16, 4e-16)),
        "positive": lambda i: rng.uniform(0, 1) * scale,
        "negative": lambda i: -rng.uniform(0, 1) * scale,
        "mixed-scales": lambda i: rng.choice((-1, 1)) * rng.choice(SCALES),
        "ramp": lambda i: sign * scale * ((i + 1) / n),
    }[shape]
    return [rng.choice(JUNK) if rng.random() < junk else make(i) for i in range(n)]


def random_length(rng: random.Random) -> int:
    return rng.choice((0, 1, 1, 2, 2, 3, 5, rng.randint(6, 90)))


def random_steps(rng: random.Random, n: int) -> list[Any]:
    start = rng.choice((0, 1, 1, 1, 10**6, 3e300, -5))
    steps = [start + i for i in range(n)]
    if n and rng.random() < 0.2:  # a resumed run logs a step twice; a step NaN or huge
        steps[rng.randrange(n)] = rng.choice((start, math.nan, math.inf, 1e308))
    return steps


@pytest.fixture(params=[False, True], ids=["denormals", "flush-to-zero"])
def flush_denormals(request):
    """Both float modes a report meets: `turnrl train` sets torch's flush-to-zero (models.py),
    so a report drawn in a process that trained computes with subnormals as 0."""
    import torch

    torch.set_flush_denormal(request.param)
    yield request.param
    torch.set_flush_denormal(False)


def _finite(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and abs(value) <= sys.float_info.max)  # NaN compares false


# ------------------------------------------------------------------------------ axis maths


def test_ticks_cover_any_finite_range_with_distinct_labels(flush_denormals):
    rng = random.Random(37)
    pairs = [(v, v) for v in (0.0, -0.0, 5e-324, -1.7976931348623157e308, 1.7976931348623157e308,
                              0.053125, 1e20, -3.0)]
    pairs += [(0.053125, 0.053125000000000006), (-1.7976931348623157e308,
                                                1.7976931348623157e308),
              (1.7971e308, 1.7976e308), (1e-300, 1e300), (0.0, 5e-324)]
    for _ in range(3000):
        a, b = random_values(rng, 2)
        pairs.append((min(a, b), max(a, b)))
    for lo, hi in pairs:
        for count, min_step in ((5, 0.0), (6, 1.0)):
            ticks = nice_ticks(lo, hi, count=count, min_step=min_step)
            assert len(ticks) >= 2 and all(map(math.isfinite, ticks)), (lo, hi, ticks)
            assert all(a < b for a, b in zip(ticks, ticks[1:], strict=False)), (lo, hi, ticks)
            assert len(ticks) <= 4 * count, (lo, hi, ticks)
            span = ticks[-1] / 2 - ticks[0] / 2
            assert ticks[0] <= lo + 1e-9 * span and ticks[-1] >= hi - 1e-9 * span, (lo, hi)
            labels = tick_labels(ticks)
            assert len(set(labels)) == len(labels), (lo, hi, ticks, labels)
            assert not any(re.fullmatch(r"-0(\.0*)?|.*(nan|inf).*", t) for t in labels), labels
            assert max(map(len, labels)) <= 16, labels


# ------------------------------------------------------------------------------ one chart


def _chart_facts(svg: str) -> dict:
    """Coordinates and labels of a chart, read back from its markup (which must be XML)."""
    root = ET.fromstring(svg)
    grid = [e for e in root.iter(f"{SVG}line") if e.get("class") == "grid"]
    ticks = [e for e in root.iter(f"{SVG}text") if e.get("class") == "tick"]
    coords = [float(v) for e in root.iter() for k, v in e.attrib.items()
              if k in ("x", "y", "x1", "x2", "y1", "y2", "cx", "cy")]
    paths = [[tuple(map(float, p.split(","))) for p in re.findall(r"[-\d.e+]+,[-\d.e+]+",
                                                                    e.get("d"))]
             for e in root.iter(f"{SVG}path")]
    circles = [(float(e.get("cx")), float(e.get("cy"))) for e in root.iter(f"{SVG}circle")]
    return {"left": float(grid[0].get("x1")), "coords": coords, "paths": paths,
            "circles": circles, "y_labels": [t.text for t in ticks if t.get("text-anchor") ==
                                             "end"],
            "x_labels": [t.text for t in ticks if t.get("text-anchor") == "middle"][:-1]}


def test_line_chart_draws_every_generated_series_inside_its_box(flush_denormals):
    rng = random.Random(2026)
    for case in range(400):
        series, expected = [], []
        for i in range(rng.choice((1, 1, 2, 3))):
            n = random_length(rng)
            steps, values = random_steps(rng, n), random_values(rng, n, junk=rng.random() / 3)
            series.append(Series(f"run{i}", "#123456", list(zip(steps, values, strict=True))))
            expected.append(sorted((s, v) for s, v in zip(steps, values, strict=True)
                                   if _finite(s) and _finite(v)))
        svg = line_chart(f"metric {case} <&>", series)
        if not any(expected):
            assert svg == "", case
            continue
        facts = _chart_facts(svg)
        assert all(math.isfinite(c) and -1 <= c <= WIDTH + 1 for c in facts["coords"]), case
        assert len(facts["paths"]) == sum(1 for e in expected if e)
        for path, points in zip(facts["paths"], [e for e in expected if e], strict=True):
            assert len(path) == len(points), case
            for x, y in path:
                assert facts["left"] - 0.1 <= x <= WIDTH - RIGHT + 0.1, (case, x)
                assert TOP - 0.1 <= y <= HEIGHT - BOTTOM + 0.1, (case, y)
            assert all(a[0] <= b[0] for a, b in zip(path, path[1:], strict=False)), case
            # a larger value is never drawn lower (SVG y grows downwards)
            for (_, ya), (_, a), in zip(path, points, strict=True):
                for (_, yb), (_, b) in zip(path, points, strict=True):
                    assert not (a < b and ya < yb - 0.05), (case, a, b, ya, yb)
        drawn = sum(len(e) for e in expected if len(e) <= 60)
        assert len(facts["circles"]) == drawn, case
        for labels in (facts["y_labels"], facts["x_labels"]):
            assert len(labels) >= 2 and len(set(labels)) == len(labels), (case, labels)
        assert facts["left"] >= LEFT


def test_line_chart_intervals_with_missing_or_non_finite_ends():
    chart = line_chart("success", [Series("a", "#000", [(1, 0.5)], [
        (1, 0.5, None, 0.7), (2, 0.4, math.nan, math.inf), (3, math.nan, 0.1, 0.2),
        (math.inf, 0.3, 0.1, 0.2)])])
    root = ET.fromstring(chart)
    # the point at step 3 (value NaN) and the one at step inf are left out
    assert len([g for g in root.iter(f"{SVG}g") if g.get("class") == "interval"]) == 2
    assert "nan" not in chart and "inf" not in chart


# ------------------------------------------------------------------------------ whole runs


class _Page(HTMLParser):
    """The charts of a report page: metric, whether it says no data, its lines' points."""

    def __init__(self, html: str):
        super().__init__()
        self.charts: list[dict] = []
        self.notes: list[str] = []
        self._in_note = False
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.charts.append({"metric": a["data-metric"], "nodata": "nodata" in a["class"],
                                "points": []})
        elif tag == "path" and a.get("class") == "line":
            self.charts[-1]["points"].append(int(a["data-points"]))
        self._in_note = tag == "li"

    def handle_data(self, data):
        if self._in_note:
            self.notes.append(data)


def _junk_eval(rng: random.Random) -> str:
    good = {"episodes": 4, "successes": 1, "mean_reward": 0.25, "mean_turns": 2.0, "failed": 0,
            "success_rate": 0.25, "ci_lo": 0.05, "ci_hi": 0.7}
    return rng.choice((json.dumps(good), json.dumps(good)[:30], json.dumps({"success_rate": 0.5}),
                       json.dumps([1, 2]), json.dumps({**good, "success_rate": None}),
                       json.dumps({**good, "ci_lo": "low"})))


FATES = ("normal", "no-metrics", "normal", "empty", "normal", "torn", "normal", "corrupt",
         "stepless")
"""What became of a generated run's metrics.jsonl (a normal run every other one)."""


def make_run(rng: random.Random, run_dir: Path, fate: str) -> dict:
    """A generated run directory; returns what its report must show (the oracle)."""
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(rng.choice((
        "env: {name: guess-number}\nrun: {steps: 2, seed: 1}\n", "run: 5\nenv: [1]\n",
        "env: {name: [unclosed\n", "")))
    n = random_length(rng)
    steps = [s for s in random_steps(rng, n)]
    logged = rng.sample(CURVES, rng.randint(0, len(CURVES)))  # the rest never logged
    values = {k: random_values(rng, n, junk=rng.choice((0.0, 0.2, 1.0))) for k in logged}
    lines, kept = [], []
    for i, step in enumerate(steps):
        record = {"step": step, "time": 1.0 + i}
        record.update({k: values[k][i] for k in logged if rng.random() > 0.1})
        record = {k: v for k, v in record.items() if not isinstance(v, dict | list)
                  or rng.random() < 0.5}
        lines.append(json.dumps(record))
        if _finite(step):
            kept.append(record)
    if fate == "stepless":
        lines.insert(0, json.dumps({"reward/mean": 1.0}))
        lines.insert(0, json.dumps({"step": "three", "reward/mean": 1.0}))
    text = "".join(line + "\n" for line in lines)
    if fate == "torn":
        text += '{"step": 99, "reward/me'
    elif fate == "corrupt" and lines:
        text = "{not json\n" + text + "[1, 2]\n"
    if fate == "empty":
        text = ""
    if fate == "no-metrics":
        kept = []
    else:
        (run_dir / "metrics.jsonl").write_text(text)
    for key in ("before", "after"):
        if rng.random() < 0.6:
            (run_dir / f"eval_{key}.json").write_text(_junk_eval(rng))
    if rng.random() < 0.3:
        (run_dir / "eval.json").write_text(rng.choice(('{"results": [{"label": "x"}]}',
                                                       '{"result": 3}', '{"res')))
    if rng.random() < 0.3:
        (run_dir / "samples").mkdir()
        (run_dir / "samples" / "step-000001.json").write_text(rng.choice((
            '{"a": 1}', '[{"reward": "high", "segments": 5}, 3]', '[{"seg')))
    return {"fate": fate, "records": [] if fate == "empty" else kept}


def expected_charts(records: list[dict]) -> dict[str, int | None]:
    """Per metric the page must chart: its number of finite points (0: "no data")."""
    out = {}
    for key in CURVES:
        if any(key in r for r in records):
            out[key] = sum(1 for r in records if _finite(r.get(key)))
    return out


@pytest.mark.parametrize("seed", range(27))
def test_report_of_generated_run_directories(tmp_path, seed):
    run = tmp_path / f"run-{seed}"
    truth = make_run(random.Random(seed), run, FATES[seed % len(FATES)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's overflow warnings are failures too
        png = write_report(run)
    assert png.read_bytes().startswith(PNG_MAGIC)
    page = _Page(write_html_report([run]).read_text())

    expected = expected_charts(truth["records"])
    shown = {c["metric"].split(" (")[0]: c for c in page.charts}
    assert set(shown) == set(expected), (truth["fate"], shown.keys(), expected)
    for key, points in expected.items():
        chart = shown[key]
        if key == "success/rate" and chart["nodata"] is False and points == 0:
            continue  # held-out squares alone (eval_after.json) still make a chart
        assert chart["nodata"] == (points == 0), (key, points, chart)
        if points:
            assert chart["points"] == [points], (key, chart)
    if truth["fate"] == "no-metrics":
        assert any("no metrics.jsonl yet" in n for n in page.notes)
    if truth["fate"] in ("torn", "corrupt", "stepless"):
        assert page.notes, truth["fate"]


def test_report_cli_on_generated_runs_writes_both_files(tmp_path, capsys):
    rng = random.Random(7)
    runs = [tmp_path / f"r{i}" for i in range(6)]
    for i, run in enumerate(runs):
        make_run(rng, run, FATES[i])
    assert main(["report", *map(str, runs)]) == 0
    assert all((run / "report.png").is_file() for run in runs)
    assert (runs[0] / "report.html").is_file()
    assert capsys.readouterr().err == ""


def test_report_of_what_is_no_run_directory_names_the_fix(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        assert main(["report", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--run.out_dir" in err and str(path) in err


def test_a_chart_that_fails_to_draw_says_no_data_and_the_page_goes_on(tmp_path, monkeypatch):
    """Fault injection: whatever breaks one chart, the rest of the page is written."""
    import turnrl.report.html as page_module

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 1.0,
                                                   "entropy": 2.0}) + "\n")
    real = page_module.line_chart

    def broken_for_entropy(title, series):
        if title == "entropy":
            raise ZeroDivisionError("injected")
        return real(title, series)

    monkeypatch.setattr(page_module, "line_chart", broken_for_entropy)
    page = _Page(write_html_report([run]).read_text())
    assert [(c["metric"], c["nodata"]) for c in page.charts] == [("reward/mean", False),
                                                                 ("entropy", True)]
    assert "ZeroDivisionError: injected" in (run / "report.html").read_text()


def test_png_panels_draw_every_generated_series_inside_their_axes(flush_denormals):
    """matplotlib is given limits and ticks it can transform: every plotted point lands
    inside its panel, finite, and a larger value is never drawn lower."""
    rng = random.Random(11)
    for case in range(30):
        n = random_length(rng) or 1
        steps = random_steps(rng, n)
        keys = rng.sample(PREFERRED_METRICS, 3)
        values = {k: random_values(rng, n, junk=rng.choice((0.0, 0.3))) for k in keys}
        records = [{"step": s, **{k: values[k][i] for k in keys}}
                   for i, s in enumerate(steps) if _finite(s)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fig = curves_figure(records, f"case {case}")
            fig.canvas.draw()
        for ax in fig.axes:
            box = ax.get_window_extent()
            for line in ax.get_lines():
                data = line.get_xydata()
                shown = ax.transData.transform(data)
                assert np.isfinite(shown).all(), (case, ax.get_title(), data)
                assert (shown[:, 0] >= box.x0 - 1).all() and (shown[:, 0] <= box.x1 + 1).all()
                assert (shown[:, 1] >= box.y0 - 1).all() and (shown[:, 1] <= box.y1 + 1).all()
                order = np.argsort(data[:, 1], kind="stable")
                assert (np.diff(shown[order, 1]) >= -0.5).all(), (case, ax.get_title())
