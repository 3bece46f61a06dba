"""`turnrl eval` end to end on the tiny model: pass@k JSON, --compare, seeds pooled."""

import json
import shutil

import pytest

from turnrl.checkpoint_eval import base_model
from turnrl.cli import main

TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.progress", "false", "--run.tensorboard", "false", "--eval.episodes", "5"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two training seeds of one config, 2 steps each (a high lr, so the weights move)."""
    root = tmp_path_factory.mktemp("runs")
    dirs = []
    for seed in (0, 1):
        out = root / f"seed-{seed}"
        assert main(["train", *TINY, "--run.steps", "2", "--optim.lr", "2e-2",
                     "--run.seed", str(seed), "--run.out_dir", str(out)]) == 0
        dirs.append(out)
    return dirs


def test_eval_json_has_pass_at_k_intervals_and_failures(runs, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(runs[0] / "checkpoints" / "step-000002"),
                 "--samples", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "pass@4" in printed and "5 held-out tasks x 4 samples (20 episodes)" in printed
    report = json.loads(out.read_text())
    result = report["result"]
    assert report["kind"] == "single" and report["env"] == "say-digit"
    assert (result["tasks"], result["samples"], result["episodes"]) == (5, 4, 20)
    assert set(result["pass_at_k"]) == {"1", "2", "4"}
    for estimate in result["pass_at_k"].values():
        assert 0 <= estimate["lo"] <= estimate["value"] <= estimate["hi"] <= 1
        assert estimate["method"] == "percentile bootstrap over tasks"
    # pass@k never falls as k grows, and pass@1 is the plain success share
    values = [result["pass_at_k"][k]["value"] for k in ("1", "2", "4")]
    assert values == sorted(values)
    successes = sum(t["successes"] for t in result["per_task"])
    assert values[0] == pytest.approx(successes / 20)
    assert sum(result["statuses"].values()) == 20  # every episode counted, none dropped
    # ... and by why it ended: say-digit ends done after its one turn
    assert result["end_reasons"] == {"done": 20}
    assert "ended: done 20" in printed
    assert result["failures"] == sum(result["statuses"].get(s, 0)
                                     for s in ("truncated", "timeout", "error"))
    for key in ("mean_turns", "mean_tokens", "mean_policy_tokens", "mean_reward"):
        assert result[key] >= 0


def test_compare_base_with_a_trained_run(runs, tmp_path, capsys):
    out = tmp_path / "cmp.json"
    assert main(["eval", "--compare", "base", str(runs[0]), "--samples", "2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    comparison = report["comparison"]
    assert comparison["test"] == "paired sign-flip permutation test on per-task pass@1"
    assert 0 < comparison["p_value"] <= 1
    d = comparison["difference"]
    a, b = (r["pass_at_k"]["1"]["value"] for r in report["results"])
    assert d["value"] == pytest.approx(a - b) and d["lo"] <= d["value"] <= d["hi"]
    assert f"p = {comparison['p_value']:.4g}" in printed
    assert [r["per_task"][0]["seed"] for r in report["results"]] == [1_000_000] * 2


def test_seeds_pool_with_a_t_interval(runs, tmp_path):
    out = tmp_path / "seeds.json"
    assert main(["eval", *map(str, runs), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    pooled = report["pooled"]["1"]
    per_seed = [r["pass_at_k"]["1"]["value"] for r in report["results"]]
    assert pooled["value"] == pytest.approx(sum(per_seed) / 2)
    assert pooled["method"] == "t-interval over 2 seed means"
    assert pooled["lo"] <= pooled["value"] <= pooled["hi"]


@pytest.mark.parametrize("argv,message", [
    (["--samples", "0"], "--samples must be a whole number >= 1"),
    (["--compare", "base"], "--compare needs two checkpoints"),
    (["--compare", "base", "base"], "compares the base model with itself"),
    (["--checkpoint", "/nonexistent"], "no checkpoint at '/nonexistent'"),
])
def test_bad_eval_arguments_are_one_line_errors(argv, message, capsys):
    assert main(["eval", *argv, *TINY]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_compare_follows_a_run_back_to_the_checkpoint_it_started_from(runs, tmp_path, capsys):
    """RL after a warm-up runs with ``model.name`` = the warm-up's checkpoint: comparing the
    two (or runs after different warm-ups) is one model, not 'different models'."""
    start = runs[0] / "checkpoints" / "step-000002"
    later = tmp_path / "later"
    assert main(["train", *TINY, "--run.steps", "1", "--model.name", str(start),
                 "--run.out_dir", str(later)]) == 0
    assert base_model(str(later / "checkpoints" / "step-000001")) == "tiny"
    assert base_model(str(start)) == "tiny" and base_model("tiny") == "tiny"
    # a checkpoint copied out of its run has no run config to follow: it is its own model
    loose = tmp_path / "loose"
    shutil.copytree(start, loose)
    assert base_model(str(loose)) == str(loose)
    capsys.readouterr()
    assert main(["eval", "--compare", str(start), str(later), "--samples", "1"]) == 0
    assert "paired" in capsys.readouterr().out
    assert main(["eval", "--compare", str(start), str(later), "--samples", "1",
                 "--env.name", "guess-number"]) == 0  # one override applies to both sides
    capsys.readouterr()
    assert main(["eval", "--compare", str(loose), str(later), "--samples", "1"]) == 2
    assert "need the same model and env" in capsys.readouterr().err


def _eval_lines(run, episodes: int) -> int:
    """Lines of TurnRL's own code that one ``turnrl eval --compare base RUN`` of ``episodes``
    tasks executes on this thread (a pure-Python loop counts for every pass; torch's and
    the other libraries' frames are not traced)."""
    import sys
    from pathlib import Path

    import turnrl

    root, lines = str(Path(turnrl.__file__).parent), 0

    def count(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return count

    sys.settrace(lambda frame, event, arg: count if frame.f_code.co_filename.startswith(root)
                 else None)
    try:
        code = main(["eval", "--compare", "base", str(run), "--eval.episodes", str(episodes)])
    finally:
        sys.settrace(None)
    assert code == 0
    return lines


def test_eval_work_grows_linearly_with_the_episodes(runs, capsys):
    """Issue 58: ``--eval.episodes 1024`` ran 44 min where 512 took 3.7. Counted, not timed:
    the lines that 2n tasks add over n, then 4n over 2n. Fixed costs (the model load) cancel;
    a linear cost doubles the increment (measured 1.98-2.04), a quadratic one heads for 4x
    (one comparison per pair of episodes, a rescan at each new one: 2.58 at these sizes).
    The fewer of two counts per size: waiting on env threads runs more lines when they are
    slow (2.33 seen on a busy machine), never fewer than the work itself."""
    _eval_lines(runs[0], 4)  # imports and first-call costs
    lines = {n: min(_eval_lines(runs[0], n) for _ in range(2))  # 2, 4, 8 chunks of 32
             for n in (64, 128, 256)}
    capsys.readouterr()
    first, second = lines[128] - lines[64], lines[256] - lines[128]
    assert first > 0 and second / first < 2.3, lines
