"""``benchmarks/learning/ranks_replay.py`` on the tiny model: the same episodes through one
process and two real gloo ranks (fsdp, a sharded checkpoint after step 1) give the same
losses, gradient norms and weights step after step (issue 52's check that the ranks update as
one process does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "learning" / "ranks_replay.py"


def test_two_fsdp_ranks_replay_the_one_process_steps():
    root = str(Path(__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--steps", "3",
                           "--save-after", "1", "--strategy", "fsdp"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"step"')]
    assert [row["step"] for row in rows] == [1, 2, 3], done.stdout
    assert any(row["one/grad_norm"] > 0 for row in rows), rows  # some step moved the weights
    for row in rows:
        assert abs(row["one/loss/policy"] - row["ranks/loss/policy"]) < 1e-5, row
        assert abs(row["one/grad_norm"] - row["ranks/grad_norm"]) <= 1e-4 * (
            1 + row["one/grad_norm"]), row
        assert row["ranks/max_abs"] < 1e-5, row  # lr 4e-5-sized steps: far below one
        if "ranks/of_step" in row:
            assert row["ranks/of_step"] < 1e-3, row
