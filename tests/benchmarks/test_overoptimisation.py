"""``benchmarks/learning/overoptimisation.py``, briefly: a reward model trained, both runs'
step-by-step proxy score and true success printed, the ratio line."""

from __future__ import annotations

import re

import pytest


@pytest.mark.slow  # four tiny runs and a reward model: ~30 s on an idle 2-core machine
def test_the_overoptimisation_benchmark_prints_both_curves_and_its_ratio(capsys, tmp_path):
    import overoptimisation

    assert overoptimisation.main(["--seeds", "1", "--steps", "2", "--episodes", "4",
                                  "--pairs", "8", "--rm-steps", "2", "--out",
                                  str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^reward model: held-out pair accuracy [\d.]+ \(8 pairs\)$", out, re.M)
    for name in ("rm", "env"):
        assert re.search(rf"^{name}: held-out success after [\d.]+ \[", out, re.M), out
    steps = re.findall(r"^\s+(\d+)\s+(-?[\d.]+)\s+([\d.]+)$", out, re.M)
    assert [int(s) for s, _, _ in steps] == [0, 1, 0, 1]
    assert all(0 <= float(success) <= 1 for _, _, success in steps)
    assert re.search(r"^ratio: rm / env held-out success = \S+$", out, re.M)
