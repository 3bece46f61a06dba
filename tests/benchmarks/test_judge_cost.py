"""``benchmarks/speed/judge_cost.py`` on the tiny model, one small round."""

from __future__ import annotations

import re


def test_judge_cost_times_both_modes_beside_the_update(capsys):
    import judge_cost

    assert judge_cost.main(["--rows", "4", "--repeats", "1", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"pointwise: 4 calls, \d/4 episodes scored", out), out
    assert re.search(r"ranking: 1 calls, \d/4 episodes scored", out), out
    assert re.search(r"^ratio: pointwise judge / update cpu = \d+\.\d\d$", out, re.M), out
