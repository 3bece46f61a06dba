"""``report.html``: one self-contained page for one or several run directories.

Learning curves (inline SVG, one line per run), the evaluation table (before/after
training, and the pass@k of ``turnrl eval --out RUN_DIR/eval.json`` when present) and a few
sample episodes as conversations, policy and environment turns told apart; the
games among them (self-play, pool) move by move with each seat's reward (report/games.py). No external
file, font or script: the page opens offline. Its one inline script only checks, in the
browser, that every chart drew its line or points, and says so at the bottom of the page.
Any run directory makes a page: what cannot be drawn or read says so where it would have
been ("no data" charts, notes under the run) instead of stopping the report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import yaml

from turnrl.config import translate_stored
from turnrl.report.data import finite, read_run_metrics, require_run_dir
from turnrl.report.games import GAME_STYLE, games_section
from turnrl.report.svg import PALETTE, Series, empty_chart, line_chart
from turnrl.types import read_episodes

CURVES = ("reward/mean", "success/rate", "entropy", "collapse/mi", "clip_fraction", "kl",
          "loss/policy", "sft/loss", "eval/loss", "episode/turns", "grad_norm")
"""Metrics drawn when logged, in this order; held-out success joins ``success/rate``."""
SUBTITLES = {
    "success/rate": " (squares: held-out, 95% CI)",
    "collapse/mi": " (template collapse: how much replies depend on their input, nats/token;"
                   " falling while entropy holds = collapse)",
}
SAMPLES_PER_RUN = 6


@dataclass
class RunData:
    name: str
    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    evals: dict[str, dict] = field(default_factory=dict)
    """'before'/'after' summaries (eval_*.json) of the training run."""
    passk: dict | None = None
    """What ``turnrl eval --out RUN_DIR/eval.json`` wrote, if it did."""
    samples: list[tuple[str, dict]] = field(default_factory=list)
    """(where from, transcript) pairs: decoded parts with their role."""
    games: list[tuple[str, list]] = field(default_factory=list)
    """(where from, every transcript of that file) for the game view (report/games.py)."""
    notes: list[str] = field(default_factory=list)
    """What the page left out of this run and why (unreadable lines or files)."""


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _dicts(value: Any) -> list[dict]:
    """The objects of a JSON list (a sample file edited or cut short may hold anything)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _setting(config: dict, section: str, key: str) -> Any:
    """``config[section][key]``, or None where the saved config lacks it or is not a mapping."""
    part = config.get(section) if isinstance(config, dict) else None
    return part.get(key) if isinstance(part, dict) else None


def _first_and_last(paths: list[Path]) -> list[Path]:
    return paths[:1] + paths[-1:] if len(paths) > 1 else paths


def _sample_files(run_dir: Path) -> list[tuple[str, list[dict]]]:
    """(name, transcripts) of the first and last step's samples and the held-out ones."""
    chosen = _first_and_last(sorted((run_dir / "samples").glob("step-*.json")))
    chosen += [p for p in [run_dir / "samples" / "eval_after.json"] if p.is_file()]
    return [(p.stem, _dicts(_json(p))) for p in chosen]


def _eval_games(passk: Any) -> list[tuple[str, list[dict]]]:
    """(``turnrl eval: LABEL``, its sample games) from ``RUN_DIR/eval.json``, for a game."""
    if not isinstance(passk, dict):
        return []
    results = passk.get("results") or [passk.get("result")]
    found = []
    for res in results if isinstance(results, list) else []:
        games = res.get("games") if isinstance(res, dict) else None
        if isinstance(games, dict):
            found.append((f"turnrl eval: {res.get('label', '?')}",
                          _dicts(games.get("samples"))))
    return found


def _samples(run_dir: Path) -> list[tuple[str, dict]]:
    """Transcripts of the first and last step and of the held-out evaluation; for runs from
    before transcripts were saved, the turns (action, observation) of the episode files."""
    found = [(name, t) for name, transcripts in _sample_files(run_dir) for t in transcripts[:2]]
    if found:
        return found[:SAMPLES_PER_RUN]
    for path in _first_and_last(sorted((run_dir / "episodes").glob("step-*.jsonl"))):
        try:
            episodes = read_episodes(path)[:2]
        except (OSError, ValueError, TypeError, KeyError):  # cut short by a kill, or older
            continue
        for ep in episodes:
            parts = [{"role": role, "text": text} for t in ep.turns
                     for role, text in (("policy", t.action), ("env", t.observation)) if text]
            found.append((path.stem, {"seed": ep.seed, "reward": ep.reward, "status": ep.status,
                                      "success": ep.success, "turns": len(ep.turns),
                                      "segments": parts}))
    return found[:SAMPLES_PER_RUN]


def _config(path: Path) -> tuple[dict, list[str]]:
    """The saved config (empty when absent), and a note when it cannot be read."""
    if not (path / "config.yaml").is_file():
        return {}, []
    try:
        config = yaml.safe_load((path / "config.yaml").read_text(errors="replace"))
    except (OSError, yaml.YAMLError):
        return {}, ["config.yaml could not be read; the run's settings are not shown"]
    return (translate_stored(config), []) if isinstance(config, dict) else ({}, [])


def load_run(run_dir: str | Path) -> RunData:
    """Everything the page shows of ``run_dir``; what cannot be read becomes a note."""
    path = require_run_dir(run_dir)
    metrics = read_run_metrics(path)
    config, notes = _config(path)
    evals = {k: d for k in ("before", "after")
             if isinstance(d := _json(path / f"eval_{k}.json"), dict)}
    passk = _json(path / "eval.json")
    return RunData(path.resolve().name, path, config, metrics.records, evals,
                   passk if isinstance(passk, dict) else None, _samples(path),
                   _sample_files(path) + _eval_games(passk), metrics.notes + notes)


def _series(run: RunData, key: str, color: str) -> Series:
    """The finite (step, value) points of ``key``; NaN, inf and null values are left out."""
    s = Series(run.name, color, [(r["step"], v) for r in run.records
                                 if (v := finite(r.get(key))) is not None])
    if key == "success/rate":  # held-out points with their intervals on the same axes
        for r in run.records:
            v = finite(r.get("eval/success"))
            if v is not None:
                s.intervals.append((r["step"], v, r.get("eval/success_lo"),
                                    r.get("eval/success_hi")))
        after, steps = run.evals.get("after", {}), [r["step"] for r in run.records]
        if finite(after.get("success_rate")) is not None and steps:
            s.intervals.append((max(steps), after["success_rate"], after.get("ci_lo"),
                                after.get("ci_hi")))  # line_chart mends a missing end
    return s


def _logged(runs: list[RunData], key: str) -> int:
    """How many records carry ``key`` at all (a value, null, NaN or anything else)."""
    return sum(key in r for run in runs for r in run.records)


def _chart(runs: list[RunData], key: str, colors: list[str]) -> str:
    """``key``'s chart; "no data" in its place when nothing finite was logged or it
    cannot be drawn; '' when no run logged ``key`` at all."""
    title = key + SUBTITLES.get(key, "")
    logged = _logged(runs, key) + (_logged(runs, "eval/success") if key == "success/rate" else 0)
    if not logged:
        return ""
    try:
        series = [_series(run, key, color) for run, color in zip(runs, colors, strict=True)]
        chart = line_chart(title, series)
    except Exception as err:  # one chart's failure must not take the whole page with it
        return empty_chart(title, f"could not draw it ({type(err).__name__}: {err})")
    return chart or empty_chart(title, f"logged {logged} time(s), never a finite number")


def _charts(runs: list[RunData]) -> str:
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(runs))]
    return "".join(_chart(runs, key, colors) for key in CURVES) or \
        "<p>No metrics logged yet.</p>"


def _pct(value: float, lo: float, hi: float) -> str:
    return f"{100 * value:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def _ended(d: dict) -> str:
    """``done 28, turn_limit 3``: why the episodes ended; "-" for files from before reasons
    were counted."""
    counts = d.get("end_reasons")
    if not isinstance(counts, dict) or not counts:
        return "-"
    return ", ".join(f"{reason} {n}" for reason, n in counts.items())


def _summary_row(d: dict) -> list[str]:
    return [_pct(d["success_rate"], d["ci_lo"], d["ci_hi"]), f"{d['mean_reward']:.3f}",
            f"{d['mean_turns']:.2f}", str(d["episodes"]), str(d["failed"]), _ended(d)]


def _passk_row(res: dict) -> list[str]:
    passes = ", ".join(f"pass@{k} {_pct(e['value'], e['lo'], e['hi'])}"
                       for k, e in res["pass_at_k"].items())
    return [passes, f"{res['mean_reward']:.3f}", f"{res['mean_turns']:.2f}",
            f"{res['tasks']} x {res['samples']}", str(res["failures"]), _ended(res)]


def _row(run: RunData, label: str, make: Any, data: Any, source: str) -> list[str]:
    """One table row; a file from another version or edited by hand gets a row saying it
    could not be read, instead of stopping the page."""
    try:
        return [run.name, label, *make(data)]
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        return [run.name, label, f"{source} could not be read ({type(err).__name__}: {err})",
                "", "", "", "", ""]


def _eval_rows(run: RunData) -> list[list[str]]:
    steps = _setting(run.config, "run", "steps") or "?"
    rows = [_row(run, label, _summary_row, run.evals[key], f"eval_{key}.json")
            for key, label in (("before", "before training"), ("after", f"after {steps} steps"))
            if key in run.evals]
    passk = run.passk or {}
    results = passk.get("results") or [passk.get("result")]
    for res in filter(None, results if isinstance(results, list) else [results]):
        label = f"turnrl eval: {res.get('label', '?')}" if isinstance(res, dict) else \
            "turnrl eval"
        rows.append(_row(run, label, _passk_row, res, "eval.json"))
    return rows


def _table(runs: list[RunData]) -> str:
    head = ["run", "policy", "success [95% CI]", "mean reward", "mean turns", "episodes",
            "failed", "ended"]
    rows = [row for run in runs for row in _eval_rows(run)]
    if not rows:
        return "<p>No held-out evaluation in these runs.</p>"
    cells = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>"
                    for row in rows)
    return ('<table class="eval"><thead><tr>' + "".join(f"<th>{escape(h)}</th>" for h in head)
            + f"</tr></thead><tbody>{cells}</tbody></table>")


def _conversation(origin: str, t: dict, open_: bool) -> str:
    verdict = "solved" if t.get("success") else "not solved"
    reward = finite(t.get("reward"))
    game = t.get("game") if isinstance(t.get("game"), dict) else {}
    seat = (f" as {game['role']} vs {game.get('opponent', '?')}"
            if "role" in game else "")  # a seat of a game: which, against whom
    head = (f"{origin}, seed {t.get('seed')}{seat}: {verdict}, reward "
            f"{'?' if reward is None else f'{reward:.3f}'}, "
            f"{t.get('turns', '?')} turns, {t.get('status', '?')}")
    parts = "".join(
        f'<div class="msg {"policy" if s.get("role") == "policy" else "env"}">'
        f'<span class="who">{"policy" if s.get("role") == "policy" else "environment"}</span>'
        f'<pre>{escape(str(s.get("text", "")))}</pre></div>' for s in _dicts(t.get("segments")))
    return (f'<details class="episode"{" open" if open_ else ""}><summary>{escape(head)}'
            f"</summary>{parts}</details>")


def _run_section(run: RunData) -> str:
    cfg = run.config
    facts = ", ".join(f"{k} {escape(str(v))}" for k, v in (
        ("env", _setting(cfg, "env", "name")), ("model", _setting(cfg, "model", "name")),
        ("advantage", _setting(cfg, "algo", "advantage")),
        ("steps", _setting(cfg, "run", "steps")), ("seed", _setting(cfg, "run", "seed")))
        if v is not None)
    notes = "".join(f'<li>{escape(n)}</li>' for n in run.notes)
    samples = "".join(_conversation(o, t, i == 0) for i, (o, t) in enumerate(run.samples)) or \
        "<p>No sample episodes saved (run.sample_episodes 0?).</p>"
    return (f'<section class="run"><h2>{escape(run.name)}</h2><p class="facts">'
            f'{escape(str(run.path))}: {facts}</p>'
            + (f'<ul class="notes">{notes}</ul>' if notes else "")
            + f"{games_section(run.games)}<h3>Sample episodes</h3>{samples}</section>")


STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1320px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px}h3{font-size:15px}
.charts{display:flex;flex-wrap:wrap;gap:10px}
svg.chart{background:#fff;border:1px solid #ddd}
svg .title{font-size:13px;font-weight:600}svg .tick,svg .legend{font-size:11px}
svg .grid{stroke:#eee}svg path.line{stroke-width:1.8}
table.eval{border-collapse:collapse}table.eval td,table.eval th{border:1px solid #ccc;
padding:4px 8px;text-align:left;vertical-align:top}table.eval th{background:#f4f4f4}
details.episode{border:1px solid #ddd;margin:6px 0;padding:4px 8px}
.msg{margin:4px 0;padding:4px 8px;border-radius:6px;max-width:90%}
.msg.env{background:#f1f1f1;border-left:4px solid #999}
.msg.policy{background:#e6f0fb;border-left:4px solid #1f77b4;margin-left:8%}
.msg .who{font-size:11px;text-transform:uppercase;color:#555}
.msg pre{white-space:pre-wrap;word-break:break-word;margin:2px 0;font:13px/1.35 monospace}
#check{color:#555;font-size:12px;margin-top:24px}
svg text.nodata{font-size:13px;fill:#888}ul.notes{color:#8a5a00}
"""

# Runs after layout: measures each chart's lines and visible points in the browser and
# writes what it found (data-drawn and data-marks on each chart, a line at the bottom), so a
# reader and a test can see it. A one-step run has points and no line length.
CHECK = """
const charts=[...document.querySelectorAll('svg.chart:not(.nodata)')];let drawn=0;
for(const c of charts){let length=0;
for(const p of c.querySelectorAll('path.line'))length+=p.getTotalLength();
const marks=[...c.querySelectorAll('.mark')].filter(m=>m.getBoundingClientRect().width>0);
const box=c.getBoundingClientRect();
const ok=(length>0||marks.length>0)&&box.width>0&&box.height>0;
c.dataset.drawn=ok?length.toFixed(0):'0';c.dataset.marks=marks.length;if(ok)drawn++;}
const empty=document.querySelectorAll('svg.chart.nodata').length;
const rows=document.querySelectorAll('table.eval tbody tr').length;
document.getElementById('check').textContent=`page check: ${drawn} of ${charts.length} `+
`charts drew their lines or points, ${empty} say no data; ${rows} evaluation rows.`;
Object.assign(document.body.dataset,{charts:charts.length,chartsDrawn:drawn,
chartsEmpty:empty,evalRows:rows});
"""


def render_page(runs: list[RunData]) -> str:
    title = "TurnRL report: " + ", ".join(run.name for run in runs)
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{STYLE}{GAME_STYLE}</style></head><body>"
            f"<h1>{escape(title)}</h1><h2>Learning curves</h2>"
            f'<div class="charts">{_charts(runs)}</div>'
            "<h2>Held-out evaluation</h2><p>Intervals are 95%: Wilson for one sample per "
            "task, a bootstrap over tasks for pass@k (docs/evaluation.md).</p>"
            f"{_table(runs)}{''.join(_run_section(run) for run in runs)}"
            f'<p id="check">page check: the script did not run.</p>'
            f"<script>{CHECK}</script></body></html>")


def write_html_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Write ``report.html`` for ``run_dirs`` (into the first one unless ``out``)."""
    if not run_dirs:
        raise ValueError("write_html_report needs at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    out_path = Path(out) if out is not None else Path(run_dirs[0]) / "report.html"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(render_page(runs), encoding="utf-8")
    return out_path
