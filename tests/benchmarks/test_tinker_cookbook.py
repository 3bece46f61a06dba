"""benchmarks/learning/tinker_cookbook.py: the warm start's demonstrations leave out every
problem the recipe trains on and every held-out problem (loaded by path: the script's module
name is the cookbook package's)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "learning" / "tinker_cookbook.py"


def _script():
    spec = importlib.util.spec_from_file_location("tinker_cookbook_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demonstrations_hold_no_recipe_or_held_out_problem(tmp_path):
    bench = _script()
    bench.sum_demos(tmp_path / "sums.jsonl", rows=2000)
    rows = [json.loads(line) for line in (tmp_path / "sums.jsonl").read_text().splitlines()]
    assert len(rows) == 2000
    asked = set()
    for row in rows:
        few_shot, answer = row["messages"][:2], row["messages"][3]
        assert few_shot[1]["weight"] == 0  # the recipe's example: context, not trained on
        x, y = map(int, row["messages"][2]["content"][len("What is "):-1].split(" + "))
        assert answer["content"] == str(x + y)
        asked.add((x, y))
    # every pair of the recipe's first 200 batches: those it trains on and the held-out ones
    assert not asked & bench.recipe_pairs()
    assert set(bench.held_out_problems()) <= bench.recipe_pairs()
    assert len(bench.held_out_problems()) == 64
    # a run's own batches may draw a held-out pair by chance: 40 steps of 8 draw 3 of them
    kept = bench.held_out_problems(40, 8)
    assert len(kept) == 61 and not set(kept) & {p for i in range(40) for p in bench.batch_pairs(i, 8)}
    assert len(bench.held_out_problems(20, 8)) == 64
