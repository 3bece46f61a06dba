"""``benchmarks/speed/cpu_matmul.py`` on the tiny model: every shape and group timed, the engines
(torch's products, the PackedLinear tree, the lean pass) compared on the same greedy tokens."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "speed"))

import cpu_matmul as bench  # noqa: E402

from turnrl.models import tiny_model  # noqa: E402
from turnrl.samplers.onednn import onednn_unusable  # noqa: E402


@pytest.mark.skipif(onednn_unusable(tiny_model(seed=0)[0]) is not None,
                    reason="this torch build has no oneDNN linear")
def test_every_shape_and_group_is_timed_and_the_engines_agree(capsys):
    results = bench.main(["--model", "tiny", "--threads", "1", "--rows", "4", "--groups", "2",
                          "--tokens", "4", "--rounds", "1"])
    shapes = bench.linear_shapes(tiny_model(seed=0)[0])
    assert [r["shape"] for r in results["products"]] == [f"{a}x{b}" for a, b in shapes]
    assert all(r["torch_us"] > 0 and r["onednn_us"] > 0 for r in results["products"])
    assert results["pack_s"] > 0
    (gen,) = results["generation"]
    assert gen["group"] == 2 and gen["greedy_same"] and gen["max_dlogp"] < 1e-3
    assert gen["tree_s"] > 0 and gen["lean_gain"] > 0 and gen["onednn_pass"] == "lean"
    assert "packing every weight" in capsys.readouterr().out
