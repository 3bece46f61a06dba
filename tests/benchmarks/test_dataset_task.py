"""benchmarks/learning/dataset_task.py: its data file's held-out split shares no operand pair
(so no row) with training, and the dataset env reads exactly that split."""

from __future__ import annotations

import json
import re

import dataset_task

from turnrl.envs.dataset import DatasetEnv


def test_the_held_out_pairs_never_appear_in_training_and_the_env_plays_only_them(tmp_path):
    path = dataset_task.write_rows(tmp_path / "sums.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    pairs = {split: {r["pair"] for r in rows if r["split"] == split} for split in ("train", "test")}
    assert pairs["train"] and pairs["test"] and not pairs["train"] & pairs["test"]
    assert 0.1 < len(pairs["test"]) / (len(pairs["train"]) + len(pairs["test"])) < 0.3
    assert all(int(r["answer"]) == sum(map(int, r["pair"].split("+"))) for r in rows)
    train = DatasetEnv(path=str(path), reward="exact_match")
    held = DatasetEnv(path=str(path), reward="exact_match", split="eval")
    assert {r["pair"] for r in train.rows} == pairs["train"]
    assert {r["pair"] for r in held.rows} == pairs["test"]


def test_a_quick_run_trains_on_the_file_and_prints_base_start_and_after(tmp_path, capsys):
    argv = ["--quick", "--methods", "guided,warmup", "--out", str(tmp_path)]
    assert dataset_task.main(argv) == 0
    out = capsys.readouterr().out
    commands = re.findall(r"^\$ (turnrl train .*)$", out, re.M)
    assert len(commands) == 2 and all(
        f"--env.options.path {tmp_path / 'sums.jsonl'} --env.options.reward exact_match" in c
        for c in commands)
    guided, warmup = (re.search(rf"^{m}\s+(\S+% \[.*?\])\s+(.+?)\s+(\S+% \[.*?\])\s+1\s", out, re.M)
                      for m in ("guided", "warmup"))
    assert guided and warmup, out
    assert guided.group(2) == "= base" and warmup.group(1) == guided.group(1)
    record = json.loads((tmp_path / "warmup" / "seed-0" / "cold_start.json").read_text())
    assert record["after"][1] == 8  # the quick budget's held-out episodes
