"""``report.html``: one self-contained page for one or several run directories.

Learning curves (inline SVG, one line per run), the evaluation table (before/after
training, and the pass@k of ``turnrl eval --out RUN_DIR/eval.json`` when present) and a few
sample episodes as conversations, policy and environment turns told apart. No external
file, font or script: the page opens offline. Its one inline script only checks, in the
browser, that every chart drew a line, and says so at the bottom of the page.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import yaml

from turnrl.metrics import read_metrics
from turnrl.report.svg import PALETTE, Series, line_chart
from turnrl.types import read_episodes

CURVES = ("reward/mean", "success/rate", "entropy", "clip_fraction", "kl", "loss/policy",
          "sft/loss", "eval/loss", "episode/turns", "grad_norm")
"""Metrics drawn when logged, in this order; held-out success joins ``success/rate``."""
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


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _first_and_last(paths: list[Path]) -> list[Path]:
    return paths[:1] + paths[-1:] if len(paths) > 1 else paths


def _samples(run_dir: Path) -> list[tuple[str, dict]]:
    """Transcripts of the first and last step and of the held-out evaluation; for runs from
    before transcripts were saved, the turns (action, observation) of the episode files."""
    chosen = _first_and_last(sorted((run_dir / "samples").glob("step-*.json")))
    chosen += [p for p in [run_dir / "samples" / "eval_after.json"] if p.is_file()]
    found = [(p.stem, t) for p in chosen for t in (_json(p) or [])[:2]]
    if found:
        return found[:SAMPLES_PER_RUN]
    for path in _first_and_last(sorted((run_dir / "episodes").glob("step-*.jsonl"))):
        for ep in read_episodes(path)[:2]:
            parts = [{"role": role, "text": text} for t in ep.turns
                     for role, text in (("policy", t.action), ("env", t.observation)) if text]
            found.append((path.stem, {"seed": ep.seed, "reward": ep.reward, "status": ep.status,
                                      "success": ep.success, "turns": len(ep.turns),
                                      "segments": parts}))
    return found[:SAMPLES_PER_RUN]


def load_run(run_dir: str | Path) -> RunData:
    path = Path(run_dir)
    if not (path / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {path}; is this a TurnRL run directory?")
    config = yaml.safe_load((path / "config.yaml").read_text()) \
        if (path / "config.yaml").is_file() else {}
    evals = {k: d for k in ("before", "after") if (d := _json(path / f"eval_{k}.json"))}
    return RunData(path.resolve().name, path, config or {}, read_metrics(path / "metrics.jsonl"),
                   evals, _json(path / "eval.json"), _samples(path))


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _series(run: RunData, key: str, color: str) -> Series:
    s = Series(run.name, color, [(r["step"], v) for r in run.records
                                 if (v := _finite(r.get(key))) is not None])
    if key == "success/rate":  # held-out points with their intervals on the same axes
        for r in run.records:
            v = _finite(r.get("eval/success"))
            if v is not None:
                lo, hi = _finite(r.get("eval/success_lo")), _finite(r.get("eval/success_hi"))
                s.intervals.append((r["step"], v, v if lo is None else lo, v if hi is None
                                    else hi))
        after, steps = run.evals.get("after"), [r["step"] for r in run.records]
        if after and steps:
            s.intervals.append((max(steps), after["success_rate"], after["ci_lo"],
                                after["ci_hi"]))
    return s


def _charts(runs: list[RunData]) -> str:
    colors = {run.name + str(i): PALETTE[i % len(PALETTE)] for i, run in enumerate(runs)}
    charts = []
    for key in CURVES:
        series = [_series(run, key, colors[run.name + str(i)]) for i, run in enumerate(runs)]
        title = key + (" (squares: held-out, 95% CI)" if key == "success/rate" else "")
        charts.append(line_chart(title, [s for s in series if s.points or s.intervals]))
    return "".join(c for c in charts if c) or "<p>No metrics logged yet.</p>"


def _pct(value: float, lo: float, hi: float) -> str:
    return f"{100 * value:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def _eval_rows(run: RunData) -> list[list[str]]:
    steps = run.config.get("run", {}).get("steps", "?")
    rows = []
    for key, label in (("before", "before training"), ("after", f"after {steps} steps")):
        if d := run.evals.get(key):
            rows.append([run.name, label, _pct(d["success_rate"], d["ci_lo"], d["ci_hi"]),
                         f"{d['mean_reward']:.3f}", f"{d['mean_turns']:.2f}",
                         str(d["episodes"]), str(d["failed"])])
    results = (run.passk or {}).get("results") or [(run.passk or {}).get("result")]
    for res in filter(None, results):
        passes = ", ".join(f"pass@{k} {_pct(e['value'], e['lo'], e['hi'])}"
                           for k, e in res["pass_at_k"].items())
        rows.append([run.name, f"turnrl eval: {res['label']}", passes, f"{res['mean_reward']:.3f}",
                     f"{res['mean_turns']:.2f}", f"{res['tasks']} x {res['samples']}",
                     str(res["failures"])])
    return rows


def _table(runs: list[RunData]) -> str:
    head = ["run", "policy", "success [95% CI]", "mean reward", "mean turns", "episodes",
            "failed"]
    rows = [row for run in runs for row in _eval_rows(run)]
    if not rows:
        return "<p>No held-out evaluation in these runs.</p>"
    cells = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>"
                    for row in rows)
    return ('<table class="eval"><thead><tr>' + "".join(f"<th>{escape(h)}</th>" for h in head)
            + f"</tr></thead><tbody>{cells}</tbody></table>")


def _conversation(origin: str, t: dict, open_: bool) -> str:
    verdict = "solved" if t.get("success") else "not solved"
    head = (f"{origin}, seed {t.get('seed')}: {verdict}, reward {t.get('reward', 0):.3f}, "
            f"{t.get('turns', '?')} turns, {t.get('status', '?')}")
    parts = "".join(
        f'<div class="msg {"policy" if s.get("role") == "policy" else "env"}">'
        f'<span class="who">{"policy" if s.get("role") == "policy" else "environment"}</span>'
        f'<pre>{escape(str(s.get("text", "")))}</pre></div>' for s in t.get("segments", []))
    return (f'<details class="episode"{" open" if open_ else ""}><summary>{escape(head)}'
            f"</summary>{parts}</details>")


def _run_section(run: RunData) -> str:
    cfg = run.config
    facts = ", ".join(f"{k} {escape(str(v))}" for k, v in (
        ("env", cfg.get("env", {}).get("name")), ("model", cfg.get("model", {}).get("name")),
        ("advantage", cfg.get("algo", {}).get("advantage")),
        ("steps", cfg.get("run", {}).get("steps")), ("seed", cfg.get("run", {}).get("seed")))
        if v is not None)
    samples = "".join(_conversation(o, t, i == 0) for i, (o, t) in enumerate(run.samples)) or \
        "<p>No sample episodes saved (run.sample_episodes 0?).</p>"
    return (f'<section class="run"><h2>{escape(run.name)}</h2><p class="facts">'
            f'{escape(str(run.path))}: {facts}</p><h3>Sample episodes</h3>{samples}</section>')


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
"""

# Runs after layout: measures each chart's lines in the browser and writes what it found
# (data-drawn on each chart, a line at the bottom), so a reader and a test can see it.
CHECK = """
const charts=[...document.querySelectorAll('svg.chart')];let drawn=0;
for(const c of charts){let length=0;
for(const p of c.querySelectorAll('path.line'))length+=p.getTotalLength();
const box=c.getBoundingClientRect();const ok=length>0&&box.width>0&&box.height>0;
c.dataset.drawn=ok?length.toFixed(0):'0';if(ok)drawn++;}
const rows=document.querySelectorAll('table.eval tbody tr').length;
document.getElementById('check').textContent=
`page check: ${drawn} of ${charts.length} charts drew their lines; ${rows} evaluation rows.`;
document.body.dataset.chartsDrawn=drawn;document.body.dataset.evalRows=rows;
"""


def render_page(runs: list[RunData]) -> str:
    title = "TurnRL report: " + ", ".join(run.name for run in runs)
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
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
