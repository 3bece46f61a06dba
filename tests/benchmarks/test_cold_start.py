"""benchmarks/learning/cold_start.py: its runs are real `turnrl train` commands (tiny model, --quick),
its table reads their results, finished runs are reused, and bad options are one line."""

from __future__ import annotations

import json
import re

import cold_start
import pytest

pytest.importorskip("gymnasium")


def test_a_quick_benchmark_runs_each_method_and_reuses_finished_runs(tmp_path, capsys):
    argv = ["--quick", "--tasks", "frozenlake", "--methods", "rl,warmup,guided", "--seeds", "1",
            "--out", str(tmp_path)]
    assert cold_start.main(argv) == 0
    out = capsys.readouterr().out
    commands = re.findall(r"^\$ (turnrl train .*)$", out, re.M)
    expected = 3 if cold_start.guidance_available() else 2
    assert len(commands) == expected
    assert "--sft.steps 1 --sft.env_demos 4" in commands[1]
    assert "--sft" not in commands[0]
    record = json.loads((tmp_path / "frozenlake" / "warmup" / "seed-0" / "cold_start.json")
                        .read_text())
    after = json.loads((tmp_path / "frozenlake" / "warmup" / "seed-0" / "eval_after.json")
                       .read_text())
    assert record["after"] == [after["successes"], after["episodes"]] and after["episodes"] == 4
    assert record["cpu_s"] > 0 and record["wall_s"] >= record["cpu_s"] / 4
    warmup = tmp_path / "frozenlake" / "warmup" / "seed-0"
    assert not (warmup / "checkpoints").exists() and not (warmup / "sft" / "checkpoints").exists()
    assert (warmup / "metrics.jsonl").exists()  # the figures stay; the 1.6 GB checkpoints go
    rows = {tuple(line.split()[:2]) for line in out.splitlines()}
    assert {("frozenlake", "rl"), ("frozenlake", "warmup"), ("frozenlake", "guided")} <= rows
    if not cold_start.guidance_available():
        assert re.search(r"^frozenlake\s+guided\s+not available in this tree", out, re.M)
    assert re.search(r"^goal .* frozenlake: (met by|not met)", out, re.M)

    assert cold_start.main(argv) == 0  # everything is there: nothing runs again
    assert "$ turnrl train" not in capsys.readouterr().out


def test_keep_checkpoints_keeps_them(tmp_path):
    argv = ["--quick", "--tasks", "frozenlake", "--methods", "warmup", "--seeds", "1",
            "--out", str(tmp_path), "--keep-checkpoints"]
    assert cold_start.main(argv) == 0
    run = tmp_path / "frozenlake" / "warmup" / "seed-0"
    assert any((run / "checkpoints").iterdir()) and any((run / "sft" / "checkpoints").iterdir())


def test_cells_are_median_success_with_wilson_or_t_intervals():
    assert cold_start.rate_cell([[0, 32]]) == "0.0% [0.0, 10.7]"
    assert cold_start.rate_cell([[8, 16], [16, 16], [12, 16]]).startswith("75.0% [")
    fast = {"after": [20, 32], "wall_s": 600.0}
    assert cold_start.meets_goal([fast])
    assert not cold_start.meets_goal([{**fast, "wall_s": 1300.0}])
    assert not cold_start.meets_goal([{**fast, "after": [15, 32]}])


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "chess"], "unknown task 'chess'; choose from: basic-arithmetic"),
    (["--methods", "rl,dpo"], "unknown method 'dpo'; choose from: rl, warmup, guided"),
])
def test_unknown_tasks_and_methods_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        cold_start.main(argv)
    assert message in capsys.readouterr().err


def test_the_reasoning_gym_task_is_two_one_digit_terms_and_its_oracle_is_right():
    pytest.importorskip("reasoning_gym")
    import asyncio

    from turnrl.envs.adapters.reasoning_gym_env import ReasoningGym

    flags = cold_start.TASKS["chain-sum"].env
    options = dict(zip(flags[::2], flags[1::2], strict=True))
    assert options.pop("--env.name") == "reasoning-gym"
    kwargs = {key.removeprefix("--env.options."): value for key, value in options.items()}
    task = kwargs.pop("task")
    env = ReasoningGym(task, **{key: int(value) for key, value in kwargs.items()})
    for seed in range(20):
        question = asyncio.run(env.reset(seed))
        terms = re.findall(r"(\d+)\s*([+-])\s*(\d+)\s*=", question)
        assert len(terms) == 1 and all(len(terms[0][i]) == 1 for i in (0, 2)), question
        reply = env.reference_player().act(question)
        assert asyncio.run(env.step(reply)).info["success"], (question, reply)
    assert set(cold_start.DEFAULT_TASKS) <= set(cold_start.TASKS)
