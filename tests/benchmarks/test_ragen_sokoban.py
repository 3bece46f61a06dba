"""benchmarks/learning/ragen_sokoban.py: each method is one real ``turnrl train`` on
``sokoban --env.options.protocol ragen`` with RAGEN's validation temperature (tiny model,
``--quick``); the table reads the runs' own evaluations; RAGEN's figure is labelled quoted."""

from __future__ import annotations

import json
import re

import pytest
import ragen_sokoban

from turnrl.stats import wilson_interval


@pytest.mark.slow
def test_a_quick_run_trains_each_method_on_ragens_protocol_and_prints_the_table(tmp_path, capsys):
    assert ragen_sokoban.main(["--quick", "--methods", "rl,warmup", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    commands = re.findall(r"^\$ (turnrl train .*)$", out, re.M)
    assert len(commands) == 2, out
    assert all("--env.name sokoban --env.options.protocol ragen" in c
               and c.endswith("--optim.micro_batch_size 2 --eval.temperature 0.5") and "--rollout.max_turns 5" in c
               for c in commands), commands
    assert "--sft.env_demos" in commands[1] and "--sft" not in commands[0]
    before = json.loads((tmp_path / "rl" / "seed-0" / "eval_before.json").read_text())
    lo, hi = wilson_interval(before["successes"], before["episodes"])
    base = f"{100 * before['successes'] / before['episodes']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("sokoban ")}
    assert set(rows) == {"rl", "warmup"} and all(base in row for row in rows.values()), out
    assert re.search(r"^  warmup: .*RAGEN uses no expert\)$", out, re.M)
    assert re.search(r"^ragen  20\.3-21\.5%  <- RAGEN .*Qwen2\.5-0\.5B-Instruct .*quoted, not run "
                     r"here$", out, re.M), out
    assert before["episodes"] == 2

    assert ragen_sokoban.main(["--quick", "--methods", "rl", "--out", str(tmp_path)]) == 0
    assert "$ turnrl train" not in capsys.readouterr().out  # a finished run is reused


def test_an_unknown_method_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        ragen_sokoban.main(["--methods", "rl,ppo"])
    assert "unknown method 'ppo'" in capsys.readouterr().err


@pytest.mark.slow
def test_frozenlake_runs_the_same_methods_on_ragens_lake(tmp_path, capsys):
    """``--env frozenlake``: the warm-up learns from the lake planner's chained replies (its
    successful episodes only) on ``gymnasium --env.options.protocol ragen``."""
    assert ragen_sokoban.main(["--quick", "--env", "frozenlake", "--methods", "warmup",
                               "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    [command] = re.findall(r"^\$ (turnrl train .*)$", out, re.M)
    assert "--env.name gymnasium --env.options.protocol ragen" in command, command
    assert "--sft.env_demos 8" in command
    demos = (tmp_path / "warmup" / "seed-0" / "train.log").read_text()
    assert "left out: the scripted player did not succeed" in demos  # slippery: not every seed
    assert re.search(r"^frozenlake +warmup ", out, re.M), out
    assert re.search(r"^ragen  18-21%  <- RAGEN .*Qwen2\.5-0\.5B-Instruct .*quoted, not run here$",
                     out, re.M), out


@pytest.mark.parametrize("env", ["sokoban", "frozenlake"])
def test_the_floors_put_the_random_mover_below_the_reference_player(env):
    """``--floors``: no model; the planner beats chance on both protocols, by far on Sokoban
    (89.1% vs 10.9% over 256 seeds when written) and less on slippery ice (46.5% vs 22.1%)."""
    rates = ragen_sokoban.floors(env, 64, seeds=64)
    assert 0.03 < rates["random"] < 0.4 and rates["reference"] > rates["random"] + 0.1, rates
