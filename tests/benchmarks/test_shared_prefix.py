"""``benchmarks/speed/shared_prefix.py`` on the tiny model: every variant timed, the rule's pick
named."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "speed"))

import shared_prefix as bench  # noqa: E402


def test_every_variant_is_timed_and_the_rules_pick_is_named(capsys):
    (result,) = bench.main(["--model", "tiny", "--groups", "4", "--rounds", "1",
                            "--threads", "1"])
    assert result["group"] == 4
    assert all(result[variant] > 0 for variant in bench.VARIANTS)
    out = capsys.readouterr().out
    assert "ratio: G=4 cached/packed = " in out and f"(the update picks {result['pick']})" in out
