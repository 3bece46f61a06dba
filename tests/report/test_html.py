"""The HTML run report, opened in a real headless Chromium (Debian's, from `make setup`)."""

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from turnrl.cli import main
from turnrl.metrics import MetricsLogger
from turnrl.report import write_html_report

TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.progress", "false", "--run.tensorboard", "false"]
HOSTILE = '</pre><script>document.title="pwned"</script><b>bold?</b> & <|im_end|>'


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: run `make setup` (it installs Debian's "
                    "chromium), or `apt-get install chromium`")
    return found


def _browser(*args: str) -> subprocess.CompletedProcess:
    # --no-sandbox: Chromium's own sandbox refuses to start as root (CI containers).
    return subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                           "--window-size=1360,1500", *args], capture_output=True, text=True,
                          timeout=180, check=True)


class _Dom(HTMLParser):
    """Elements (tag, attributes, text inside) of the DOM Chromium dumped."""

    def __init__(self, html: str):
        super().__init__()
        self.elements: list[dict] = []
        self._open: list[dict] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        element = {"tag": tag, "attrs": dict(attrs), "text": ""}
        self.elements.append(element)
        if tag not in ("circle", "line", "rect", "path", "meta", "br"):
            self._open.append(element)

    def handle_endtag(self, tag):
        while self._open and self._open.pop()["tag"] != tag:
            pass

    def handle_data(self, data):
        for element in self._open:
            element["text"] += data

    def find(self, tag: str, cls: str | None = None) -> list[dict]:
        return [e for e in self.elements if e["tag"] == tag
                and (cls is None or cls in e["attrs"].get("class", "").split())]


def _rendered(page: Path) -> _Dom:
    """The DOM after the page's script ran, as Chromium holds it."""
    return _Dom(_browser("--dump-dom", page.resolve().as_uri()).stdout)


def _hand_made_run(run_dir: Path, steps: int = 12) -> None:
    with MetricsLogger(run_dir) as logger:
        for step in range(1, steps + 1):
            logger.log(step, {"reward/mean": step / steps, "success/rate": step / (steps + 2),
                              "entropy": 2.0 / step, "clip_fraction": 0.01 * (step % 3),
                              **({"eval/success": 0.5, "eval/success_lo": 0.3,
                                  "eval/success_hi": 0.7} if step == 6 else {})})
    (run_dir / "config.yaml").write_text("env: {name: guess-number}\nrun: {steps: 12}\n")
    for key, rate in (("before", 0.1), ("after", 0.8)):
        (run_dir / f"eval_{key}.json").write_text(json.dumps(
            {"episodes": 10, "successes": int(10 * rate), "mean_reward": rate,
             "mean_turns": 3.0, "failed": 1, "success_rate": rate, "ci_lo": rate / 2,
             "ci_hi": min(1.0, rate * 1.2),
             **({"end_reasons": {"done": 8, "turn_limit": 1, "env_timeout": 1}}
                if key == "after" else {})}))
    (run_dir / "samples").mkdir()
    (run_dir / "samples" / "step-000001.json").write_text(json.dumps([{
        "seed": 3, "reward": 1.0, "success": True, "status": "done", "turns": 1,
        "segments": [{"role": "env", "text": "Guess a number <1..10>."},
                     {"role": "policy", "text": HOSTILE}]}]))


def test_report_renders_curves_table_and_escaped_conversation_in_chromium(tmp_path):
    a, b = tmp_path / "seed-a", tmp_path / "seed-b"
    for run in (a, b):
        run.mkdir()
        _hand_made_run(run)
    page = write_html_report([a, b])
    assert page == a / "report.html"
    dom = _rendered(page)

    charts = dom.find("svg", "chart")
    metrics = [c["attrs"]["data-metric"] for c in charts]
    assert metrics[:4] == ["reward/mean", "success/rate (squares: held-out, 95% CI)",
                           "entropy", "clip_fraction"]
    # the page's script measured every chart's lines in the browser
    assert all(float(c["attrs"]["data-drawn"]) > 100 for c in charts)
    body = dom.find("body")[0]["attrs"]
    assert body["data-charts-drawn"] == str(len(charts))
    lines = dom.find("path", "line")
    assert len(lines) == 2 * len(charts)  # one line per run in every chart
    assert all(p["attrs"]["d"].count("L") == 11 for p in lines)  # 12 steps, 12 points
    assert len(dom.find("g", "interval")) == 2 * 2  # step 6 and "after", for each run

    rows = dom.find("table", "eval")[0]["text"]
    assert "before training" in rows and "80.0% [40.0, 96.0]" in rows
    # why the episodes ended; a file from before reasons were counted says so with "-"
    assert "done 8, turn_limit 1, env_timeout 1" in rows and "ended" in rows
    assert [c["text"] for c in dom.find("td")][7] == "-"
    assert body["data-eval-rows"] == "4"

    # policy and environment turns told apart; the hostile text shown, not run
    assert "Guess a number <1..10>." in dom.find("div", "env")[0]["text"]
    assert HOSTILE in dom.find("div", "policy")[0]["text"]
    assert len(dom.find("script")) == 1
    assert "pwned" not in dom.find("title")[0]["text"]


def test_report_draws_the_template_collapse_curve_beside_entropy_in_chromium(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run) as logger:  # MI falls while entropy holds: template collapse
        for step in range(1, 6):
            logger.log(step, {"reward/mean": 0.5, "entropy": 2.0,
                              "collapse/mi": 0.8 / step, "collapse/retrieval": 1 / step})
    dom = _rendered(write_html_report([run]))
    charts = {c["attrs"]["data-metric"].split(" (")[0]: c for c in dom.find("svg", "chart")}
    assert list(charts) == ["reward/mean", "entropy", "collapse/mi"]
    assert "template collapse" in charts["collapse/mi"]["attrs"]["data-metric"]
    assert float(charts["collapse/mi"]["attrs"]["data-drawn"]) > 100


@pytest.mark.slow
def test_report_of_a_real_run_in_chromium_and_its_screenshot(tmp_path):
    """A real tiny-model run: the trainer's sample transcripts, metrics and evaluations
    make a page Chromium draws (the screenshot has the curves' blue in it)."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--run.steps", "3", "--eval.episodes", "4",
                 "--eval.every", "1", "--run.out_dir", str(run)]) == 0
    transcripts = json.loads((run / "samples" / "step-000003.json").read_text())
    assert {s["role"] for s in transcripts[0]["segments"]} == {"env", "policy"}
    assert main(["report", str(run)]) == 0
    dom = _rendered(run / "report.html")
    charts = dom.find("svg", "chart")
    assert len(charts) >= 4 and all(_drawn(c) for c in charts)
    assert len(dom.find("div", "policy")) >= 1 and len(dom.find("div", "env")) >= 1
    assert "after 3 steps" in dom.find("table", "eval")[0]["text"]

    shot = tmp_path / "shot.png"
    _browser(f"--screenshot={shot}", (run / "report.html").resolve().as_uri())
    pixels = imread(shot)[..., :3]
    blue = np.all(np.abs(pixels - np.array([0x1F, 0x77, 0xB4]) / 255) < 0.05, axis=-1)
    assert blue.sum() > 500  # the curves' colour, drawn
    assert pixels.std() > 0.05  # not a blank page


def _page_check(dom: _Dom) -> tuple[dict, list[dict]]:
    """What the page's script found (body attributes) and the charts it measured."""
    body = dom.find("body")[0]["attrs"]
    assert "data-charts" in body, "the page's script did not run"
    return body, dom.find("svg", "chart")


@pytest.mark.parametrize("steps", [1, 2])
def test_report_of_a_one_and_two_step_run_in_chromium(tmp_path, steps, capsys):
    """Issue 37: a 2-step run's near-equal floats stopped `turnrl report` (math domain
    error) after report.png and before report.html."""
    run = tmp_path / f"run-{steps}"
    assert main(["train", *TINY, "--run.steps", str(steps), "--eval.episodes", "2",
                 "--rollout.groups_per_step", "2", "--rollout.group_size", "2",
                 "--run.sample_episodes", "1", "--run.out_dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.split() == [str(run / "report.png"), str(run / "report.html")]
    assert (run / "report.png").read_bytes().startswith(b"\x89PNG")
    body, charts = _page_check(_rendered(run / "report.html"))
    assert len(charts) >= 5 and not any("nodata" in c["attrs"]["class"] for c in charts)
    assert body["data-charts-drawn"] == body["data-charts"] == str(len(charts))
    for chart in charts:
        if steps == 1:  # one point a line: no length, its marker drawn
            assert int(chart["attrs"]["data-marks"]) >= 1
        else:
            assert _drawn(chart), chart["attrs"]["data-metric"]


def _drawn(chart: dict) -> bool:
    """A line of some length; or, for the collapse monitor (logged every
    ``run.collapse_every`` 5 updates: one point in a short run), its point's marker."""
    if chart["attrs"]["data-metric"].startswith("collapse/"):
        return float(chart["attrs"]["data-drawn"]) > 0 or int(chart["attrs"]["data-marks"]) >= 1
    return float(chart["attrs"]["data-drawn"]) > 0


def _metrics(run_dir: Path, lines: list[str]) -> None:
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("run: {steps: 5}\n")
    if lines:
        (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


def _records(rows: list[dict]) -> list[str]:
    return [json.dumps({"step": i + 1, **row}) for i, row in enumerate(rows)]


EDGE_RUNS = {  # name: (metrics.jsonl lines, charts drawn, charts saying "no data")
    "one-point": (_records([{"reward/mean": 0.5, "entropy": 0.0, "kl": -2e-9,
                             "grad_norm": 1e300}]), 4, 0),
    # the issue's run: 0.053125 then 0.053125000000000006 (one float apart)
    "constant": (_records([{"reward/mean": (0.053125, 0.053125000000000006)[i % 2],
                            "clip_fraction": 0.0, "entropy": -3.0, "kl": 5e-324}
                           for i in range(6)]), 4, 0),
    "extreme": (_records([{"reward/mean": (-1) ** i * 1.7e308, "entropy": 1e-300 * i,
                           "kl": 10.0 ** (i * 60 - 150), "grad_norm": 1e20 + i}
                          for i in range(6)]), 4, 0),
    "nan-and-inf": (_records([{"reward/mean": float("nan"), "entropy": float("inf"),
                               "kl": [None, 1.0, float("-inf")][i % 3],
                               "grad_norm": "12"} for i in range(6)]), 1, 3),
    "killed-before-first-metric": ([], 0, 0),
    "only-a-torn-line": (['{"step": 1, "reward/me'], 0, 0),
}


@pytest.mark.parametrize("case", list(EDGE_RUNS))
def test_edge_case_runs_draw_or_say_no_data_in_chromium(tmp_path, case):
    lines, drawn, empty = EDGE_RUNS[case]
    run = tmp_path / case
    _metrics(run, lines)
    assert main(["report", str(run)]) == 0
    assert (run / "report.png").read_bytes().startswith(b"\x89PNG")
    dom = _rendered(run / "report.html")
    body, charts = _page_check(dom)
    assert (body["data-charts-drawn"], body["data-charts-empty"]) == (str(drawn), str(empty))
    assert len(charts) == drawn + empty
    for chart in charts:
        if "nodata" in chart["attrs"]["class"]:
            assert "no data: logged 6 time(s), never a finite number" in chart["text"]
        else:
            assert float(chart["attrs"]["data-drawn"]) > 0 or int(chart["attrs"]["data-marks"])
            assert not any(w in chart["text"].lower() for w in ("nan", "inf")), chart["text"]
    if not drawn + empty:
        assert "No metrics logged yet." in dom.find("div", "charts")[0]["text"]
        assert ("no metrics.jsonl yet" if not lines else "last line is cut short") in \
            dom.find("ul", "notes")[0]["text"]
