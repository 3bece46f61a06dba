"""``benchmarks/env_threads.py`` end to end, briefly: both ways run and the ratio is printed."""

from __future__ import annotations

import re

import env_threads


def test_shared_and_own_env_threads_side_by_side(capsys):
    assert env_threads.main(["--latencies", "0", "--rounds", "1", "--seconds", "1"]) == 0
    out = capsys.readouterr().out
    rows = {way: float(n) for way, n in re.findall(r"(shared|own threads)\s+(\d+) rows/s", out)}
    assert set(rows) == {"shared", "own threads"} and all(n > 0 for n in rows.values()), out
    ratio = re.search(r"^ratio: shared / own threads rows per second at 0 ms = (\S+)$", out, re.M)
    # Printed rows/s are rounded to whole rows: the ratio agrees to within that rounding.
    assert ratio and abs(float(ratio.group(1)) - rows["shared"] / rows["own threads"]) < 0.03
