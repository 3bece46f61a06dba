"""``benchmarks/speed/learner_ranks.py`` end to end on the tiny model: both variants train,
report their stages and per-rank memory, and end with the ratio line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "speed" / "learner_ranks.py"


def test_one_process_and_two_ranks_side_by_side():
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--steps", "2",
                           "--rounds", "1"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = dict(re.findall(r"^(world_size [12])\s+(.*)$", done.stdout, re.M))
    assert set(rows) == {"world_size 1", "world_size 2"}, done.stdout
    assert "failed" not in done.stdout
    peaks = re.findall(r"\[([\d, ]+)\]$", rows["world_size 2"])
    assert peaks and len(peaks[0].split(",")) == 2  # one peak per rank
    ratio = re.search(r"^ratio: world_size 2 / 1 update seconds \(fsdp\) = (\S+)$", done.stdout,
                      re.M)
    assert ratio and float(ratio.group(1)) > 0, done.stdout
