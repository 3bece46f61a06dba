"""``benchmarks/guards/generation_guard.py``: the verdict on hand-made round figures, its git and
process plumbing, one real HEAD-vs-HEAD run on the tiny model, and the whole-step guard
(``--whole-step``) passing against HEAD and failing on a tree slowed for real."""

from __future__ import annotations

import io
import math
import re
import subprocess
from pathlib import Path

import generation_guard as guard
import pytest

ROOT = Path(__file__).resolve().parents[2]
ROUND = re.compile(r"^round (\d+)/(\d+) \((base|this) then (base|this), load \S+, now \S+\): "
                   r"G=4 base (\S+) this (\S+) \(x(\S+)\)  G=16 base (\S+) this (\S+) \(x(\S+)\)$")


def _worktrees() -> set[str]:
    listing = subprocess.run(["git", "-C", str(ROOT), "worktree", "list", "--porcelain"],
                             capture_output=True, text=True, check=True).stdout
    return {line.split(" ", 1)[1] for line in listing.splitlines() if line.startswith("worktree ")}


# ---- the verdict -----------------------------------------------------------------------------


def test_round_ratios_pair_rounds_and_refuse_bad_figures():
    assert guard.round_ratios([1.2, 1.5], [1.0, 1.25]) == pytest.approx([1.2, 1.2])
    with pytest.raises(ValueError, match="2 rounds of this tree but 3 of the base"):
        guard.round_ratios([1.0, 1.0], [1.0, 1.0, 1.0])
    for bad in ([0.0, 1.0], [1.0, math.nan], [-1.0, 1.0], [1.0, math.inf]):
        with pytest.raises(ValueError, match="finite and positive"):
            guard.round_ratios([1.0, 1.0], bad)


def test_binomial_tail_by_hand():
    assert guard.binomial_tail(3, 0) == 1 / 8
    assert guard.binomial_tail(8, 1) == 9 / 256
    assert guard.binomial_tail(10, 2) == 56 / 1024
    assert guard.binomial_tail(4, 4) == 1


@pytest.mark.parametrize("values, bound, confidence", [
    ([1.3, 1.2, 1.25], 1.2, 7 / 8),  # few rounds: the smallest, at 1 - 2**-3
    ([1.0], 1.0, 0.5),
    ([1.1, 0.9, 1.0, 1.2, 1.05], 0.9, 31 / 32),
    # 10 rounds: the 3rd smallest (P(2 or fewer of 10 below the median) = 56/1024 <= 0.1)
    ([1.9, 1.0, 1.8, 1.1, 1.7, 1.2, 1.6, 1.3, 1.5, 1.4], 1.2, 1 - 56 / 1024),
])
def test_median_lower_bound_is_the_sign_test_order_statistic(values, bound, confidence):
    got, achieved = guard.median_lower_bound(values, 0.9)
    assert got == bound and achieved == pytest.approx(confidence)


def test_median_lower_bound_never_exceeds_the_median_and_tightens_with_rounds():
    ratios = [1.0 + 0.01 * ((7 * i) % 13) for i in range(40)]
    for n in range(1, 41):
        bound, achieved = guard.median_lower_bound(ratios[:n], 0.9)
        assert bound <= sorted(ratios[:n])[(n - 1) // 2]
        assert achieved >= 0.9 or bound == min(ratios[:n])  # the smallest when too few rounds
    assert guard.median_lower_bound(ratios, 0.9)[0] > min(ratios)
    with pytest.raises(ValueError, match="no values"):
        guard.median_lower_bound([])


@pytest.mark.parametrize("ratios, outcome", [
    ([1.25, 1.19, 1.31], guard.REGRESSION),  # the issue-36 tree: slower in every round
    ([1.24, 1.22, 1.18, 1.21, 1.30], guard.REGRESSION),
    ([1.02, 2.5, 0.98], guard.PASS),  # one round beside a busy neighbour: not a regression
    ([1.3, 1.25, 1.05], guard.INCONCLUSIVE),  # the median is over, one round is not
    ([0.97, 1.03, 1.0, 0.99, 1.05], guard.PASS),  # the same tree twice
    ([0.8, 0.82, 0.85], guard.PASS),  # faster
    ([1.10, 1.10, 1.10], guard.PASS),  # at the threshold is not over it
])
def test_judge_hand_made_rounds(ratios, outcome):
    verdict = guard.judge("G=4", ratios, 1.10)
    assert verdict.outcome == outcome
    assert verdict.median == pytest.approx(sorted(ratios)[len(ratios) // 2])
    assert verdict.lower_bound <= verdict.median
    assert guard.exit_code([verdict]) == (outcome == guard.REGRESSION)


def test_judge_threshold_and_bad_ratios():
    assert guard.judge("G=4", [1.25, 1.19, 1.31], 1.20).outcome == guard.INCONCLUSIVE
    assert guard.judge("G=4", [1.25, 1.19, 1.31], 1.30).outcome == guard.PASS
    for bad in ([], [1.0, math.nan], [1.0, 0.0], [math.inf]):
        with pytest.raises(ValueError, match="G=16: ratios must be finite and positive"):
            guard.judge("G=16", bad, 1.10)


def test_exit_code_fails_when_any_workload_regressed():
    regressed = guard.judge("G=4", [1.3, 1.3, 1.3], 1.10)
    fine = guard.judge("G=16", [1.0, 1.0, 1.0], 1.10)
    unsure = guard.judge("G=16", [1.3, 1.3, 1.0], 1.10)
    assert guard.exit_code([fine, regressed]) == 1
    assert guard.exit_code([fine, unsure]) == 0
    assert guard.exit_code([]) == 0


def test_rounds_alternate_which_tree_goes_first():
    assert [guard.round_order(i) for i in range(4)] == [
        ("base", "this"), ("this", "base"), ("base", "this"), ("this", "base")]


def test_report_prints_medians_ratios_and_the_verdict():
    figures = {"base": {"G=4": [1.10, 1.20, 1.00], "G=16": [1.50, 1.60, 1.40]},
               "this": {"G=4": [1.40, 1.50, 1.30], "G=16": [1.50, 1.70, 1.40]}}
    out = io.StringIO()
    verdicts = guard.report(figures, 1.10, 0.9, out=out)
    text = out.getvalue()
    assert [v.outcome for v in verdicts] == [guard.REGRESSION, guard.PASS]
    assert re.search(r"^G=4\s+1\.100\s+1\.400\s+1\.273\s+1\.250 \(88%\)\s+REGRESSION$", text,
                     re.M), text
    assert re.search(r"^G=16\s+1\.500\s+1\.500\s+1\.000\s+1\.000 \(88%\)\s+pass$", text, re.M)
    assert guard.RATIO_LINE + "G=4 1.273, G=16 1.000" in text
    assert text.splitlines()[-1].startswith("verdict: REGRESSION in G=4:")

    figures["this"]["G=4"] = [1.40, 1.50, 1.05]
    out = io.StringIO()
    assert guard.exit_code(guard.report(figures, 1.10, 0.9, out=out)) == 0
    assert out.getvalue().splitlines()[-1].startswith("verdict: inconclusive in G=4:")


# ---- refs, worktrees, processes --------------------------------------------------------------


@pytest.mark.parametrize("text, ref", [
    ("3100a78\n", "3100a78"),
    ("# comment\n\n  # indented comment\nabc123  why it is the base\nother\n", "abc123"),
])
def test_recorded_base_reads_the_first_ref(text, ref):
    assert guard.recorded_base(text) == ref


@pytest.mark.parametrize("text", ["", "# only a comment\n\n", "   \n"])
def test_recorded_base_refuses_a_file_without_a_ref(text):
    with pytest.raises(guard.GuardError, match="names no commit; .* pass --base REF"):
        guard.recorded_base(text)


def test_the_recorded_base_is_a_commit_of_this_repository():
    ref = guard.recorded_base(guard.BASE_FILE.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", guard.resolve_commit(ROOT, ref, "--base"))


@pytest.mark.parametrize("ref", ["no-such-branch", "HEAD~100000", "HEAD:README.md", ""])
def test_a_ref_that_names_no_commit_is_one_line(ref):
    with pytest.raises(guard.GuardError) as err:
        guard.resolve_commit(ROOT, ref, "--base")
    assert str(err.value).startswith(f"--base '{ref}' is not a commit of")
    assert "\n" not in str(err.value)


def test_main_with_a_bad_ref_exits_2_in_one_line_and_leaves_no_worktree(capsys):
    before = _worktrees()
    assert guard.main(["--base", "no-such-branch", "--model", "tiny"]) == 2
    assert guard.main(["--base", "HEAD", "--this", "nope~3", "--model", "tiny"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("generation_guard: error: --base 'no-such-branch' is not a commit")
    assert err[1].startswith("generation_guard: error: --this 'nope~3' is not a commit")
    assert len(err) == 2 and _worktrees() == before


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--collections", "0"], "--collections must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--groups", "0"], "--groups must be >= 1"),
    (["--threshold", "0"], "--threshold must be > 0"),
    (["--confidence", "1"], "--confidence must be between 0 and 1"),
])
def test_bad_options_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        guard.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_temporary_worktree_is_that_commit_and_is_removed_even_on_error():
    before = _worktrees()
    parent = guard.resolve_commit(ROOT, "HEAD~1", "--base")
    with pytest.raises(RuntimeError, match="inside"):
        with guard.temporary_worktree(ROOT, parent) as tree:
            assert guard.git(tree, "rev-parse", "HEAD") == parent
            assert (tree / "turnrl" / "__init__.py").is_file()
            assert str(tree) in _worktrees()
            raise RuntimeError("inside")
    assert not tree.exists() and not tree.parent.exists()
    assert _worktrees() == before


def test_a_tree_without_turnrl_is_refused_not_measured_with_another(tmp_path):
    """Such a folder on PYTHONPATH would fall through to whichever turnrl is installed (the
    venv's editable checkout) and time that tree instead."""
    spec = {"model_dir": str(tmp_path), "groups": [2], "collections": 1, "warmup": 0,
            "length": 2, "threads": 1, "seed": 0}
    (tmp_path / "turnrl").mkdir()  # a folder of that name is not the package
    with pytest.raises(guard.GuardError, match=re.escape(f"{tmp_path} has no turnrl/ package")):
        guard.run_child(tmp_path, spec, timeout_s=600)


# ---- one real run ------------------------------------------------------------------------------


@pytest.mark.slow
def test_head_against_head_on_the_tiny_model(capsys):
    """Four fresh processes (2 rounds x 2 trees) on the tiny model: the format, alternation
    and a finite ratio; the verdict is not asserted (a busy machine may slow either side)."""
    before = _worktrees()
    code = guard.main(["--base", "HEAD", "--model", "tiny", "--rounds", "2", "--collections",
                       "2", "--length", "4", "--threads", "1"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].startswith("base: ") and lines[2].startswith("this: working tree at ")
    rounds = [ROUND.match(line) for line in lines if line.startswith("round ")]
    assert len(rounds) == 2 and all(rounds), out
    assert [m.group(3, 4) for m in rounds] == [("base", "this"), ("this", "base")]
    for match in rounds:
        base4, this4, x4 = (float(v) for v in match.group(5, 6, 7))
        assert base4 > 0 and this4 > 0
        # the printed seconds are rounded to 1 ms: the printed ratio agrees within that
        rounding = 5e-4 / base4 + 5e-4 / this4 + 5e-4
        assert x4 == pytest.approx(this4 / base4, rel=rounding), match.group(0)
    ratio = re.search(r"^" + re.escape(guard.RATIO_LINE) + r"G=4 (\S+), G=16 (\S+)$", out, re.M)
    assert ratio and all(math.isfinite(float(r)) and float(r) > 0 for r in ratio.groups()), out
    assert code == int(lines[-1].startswith("verdict: REGRESSION")), out
    assert code in (0, 1) and lines[-1].startswith("verdict: ")
    assert _worktrees() == before


def test_learner_pass_runs_backward_and_leaves_no_trace():
    """The pass between collections does the trainer's kind of work (a backward pass on the
    main thread) but changes nothing the next collection sees: weights, gradients, mode."""
    import torch

    from turnrl.models import tiny_model
    from turnrl.types import Episode

    model, _ = tiny_model(seed=0)
    model.eval()
    weights = [p.detach().clone() for p in model.parameters()]
    episodes = []
    for length in (7, 9):  # rows of unequal length are cut to the shortest
        episode = Episode(env="toy", seed=0, group=0)
        episode.append(list(range(3, 3 + length)), policy=False)
        episodes.append(episode)
    seen = []
    hook = model.lm_head.register_full_backward_hook(lambda *_: seen.append(True))
    guard.learner_pass(model, episodes)
    hook.remove()
    assert seen  # a backward pass ran
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_kill_cleans_up_as_ctrl_c_does():
    """SIGTERM (`kill`, a CI job cancelled) mid-measurement: exit 130, the base's temporary
    worktree and folders removed, no measuring process left behind."""
    import signal
    import sys
    import tempfile
    import time

    before = _worktrees()
    scratch = set(Path(tempfile.gettempdir()).glob("turnrl-guard-*"))
    guard_process = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "guards" / "generation_guard.py"), "--base", "HEAD",
         "--model", "tiny", "--rounds", "2", "--collections", "50", "--threads", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in guard_process.stdout:  # measuring starts after the "this:" line
        lines.append(line)
        if line.startswith("this: "):
            break
    time.sleep(2)
    assert _worktrees() != before  # the base's worktree exists while it measures
    guard_process.send_signal(signal.SIGTERM)
    _, err = guard_process.communicate(timeout=120)
    assert guard_process.returncode == 130, "".join(lines) + err
    assert "interrupted" in err
    assert _worktrees() == before
    assert set(Path(tempfile.gettempdir()).glob("turnrl-guard-*")) <= scratch
    children = subprocess.run(["pgrep", "-f", "generation_guard.py --child"],
                              capture_output=True, text=True).stdout.split()
    assert not children


# ---- the whole-step guard (--whole-step, issue 57 item 4) --------------------------------------


def test_the_recorded_step_base_is_a_commit_of_this_repository():
    ref = guard.recorded_base(guard.STEP_BASE_FILE.read_text(), guard.STEP_BASE_FILE)
    assert re.fullmatch(r"[0-9a-f]{40}", guard.resolve_commit(ROOT, ref, "--base"))


def test_whole_step_and_slow_this_options():
    args = guard.parse_args(["--whole-step", "--slow-this", "2.5"])
    assert args.whole_step and args.slow_this == 2.5
    plain = guard.parse_args([])
    assert not plain.whole_step and plain.slow_this == 1.0
    assert "whole GRPO steps (collect + update)" in guard.headline(args, [4, 16])
    assert "timed steps per G" in guard.headline(args, [4])
    assert "lock-step arithmetic collections" in guard.headline(plain, [4])


def test_slow_this_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        guard.parse_args(["--slow-this", "0.5"])
    assert "--slow-this must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_stretch_holds_a_call_to_the_factor_on_its_clock(clock):
    timer = guard.CLOCKS[clock]
    start = timer()
    while timer() - start < 0.02:  # 20 ms of work on either clock
        pass
    worked = timer() - start
    guard.stretch(start, clock, 3.0)
    assert timer() - start >= 3.0 * worked
    start = timer()
    guard.stretch(start, clock, 1.0)  # off: returns at once
    assert timer() - start < 0.01


def test_report_names_the_step_and_prints_stages():
    figures = {"base": {"G=4": [1.0, 1.0, 1.0]}, "this": {"G=4": [1.3, 1.25, 1.2]}}
    out = io.StringIO()
    verdicts = guard.report(figures, 1.10, 0.9, out=out, what="step")
    assert verdicts[0].outcome == guard.REGRESSION
    assert guard.ratio_prefix("step") + "G=4 1.250" in out.getvalue()
    assert "this tree's step is over 1.10x" in out.getvalue().splitlines()[-1]
    stages = {"base": {"G=4": {"collect": [0.5, 0.7, 0.6], "update": [0.4, 0.4, 0.4]}},
              "this": {"G=4": {"collect": [0.6, 0.6, 0.6], "update": [0.8, 0.7, 0.6]}}}
    out = io.StringIO()
    guard.print_stages(stages, out=out)
    assert out.getvalue() == ("G=4 stages, wall s of each tree's fastest step, medians of rounds: "
                              "collect base 0.600 this 0.600 (x1.000)  "
                              "update base 0.400 this 0.700 (x1.750)\n")


STEP_RUN = ["--whole-step", "--base", "HEAD", "--model", "tiny", "--groups", "4", "--collections",
            "3", "--length", "8", "--threads", "1", "--clock", "cpu"]


def _step_ratio(out: str) -> float:
    match = re.search(r"^" + re.escape(guard.ratio_prefix("step")) + r"G=4 (\S+)$", out, re.M)
    assert match, out
    return float(match.group(1))


@pytest.mark.slow
def test_whole_step_head_against_head_passes_and_a_slowed_tree_fails(capsys):
    """The whole step (collect + update) of the working tree against HEAD on the tiny model,
    in fresh processes (2 rounds x 2 trees): a ratio near 1 and exit 0; then one round with
    this tree's steps held to 3x their time (``--slow-this 3``): a measured ratio near 3 and
    exit 1 at the default threshold (1.10). CPU seconds at 1 thread, which a busy machine
    disturbs far less than wall time; still, the same tree twice measured 1.23 and 0.97 in
    two rounds at load 25, so the same-tree run is judged at 1.5, above such noise."""
    before = _worktrees()
    code = guard.main([*STEP_RUN, "--rounds", "2", "--threshold", "1.5"])
    out = capsys.readouterr().out
    assert "whole GRPO steps" in out.splitlines()[0]
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and all(re.search(r"G=4 base \S+ this \S+ \(x\S+\)$", r)
                                    for r in rounds), out
    assert re.search(r"^G=4 stages, .* collect base \S+ this \S+ \(x\S+\)  update base", out,
                     re.M), out
    assert re.search(r"^machine: .*torch 1 threads", out, re.M), out
    assert code == 0 and 0.67 < _step_ratio(out) < 1.5, out
    assert out.splitlines()[-1].startswith(("verdict: pass", "verdict: inconclusive")), out

    code = guard.main([*STEP_RUN, "--rounds", "1", "--slow-this", "3"])
    out = capsys.readouterr().out
    assert "slowed to 3x on purpose" in out.splitlines()[2], out
    assert code == 1 and _step_ratio(out) > 1.5, out
    assert out.splitlines()[-1].startswith("verdict: REGRESSION in G=4: this tree's step"), out
    # The guard's own worktrees are gone (others may add theirs to a shared repository meanwhile).
    assert not [tree for tree in _worktrees() - before if "turnrl-guard-" in tree]
