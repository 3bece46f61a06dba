"""``turnrl rm``: held-out accuracy rises on a toy preference set, the output loads as
``reward.model``, a resumed run ends where an uninterrupted one does, one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.preference_data import TINY_RM, rm_config, write_pairs
from turnrl.config import ConfigError
from turnrl.metrics import read_metrics
from turnrl.models import tiny_tokenizer
from turnrl.rewards.model import RewardModel, render_conversation
from turnrl.sft.reward_model import train_reward_model


def test_training_raises_held_out_accuracy_and_the_output_loads(tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl")
    result = train_reward_model(rm_config(data, tmp_path / "rm"))
    assert result.train_pairs == 30 and result.held_out_pairs == 10
    assert result.after["accuracy"] >= 0.9 > result.before["accuracy"]
    assert result.after["loss"] < 0.5 * result.before["loss"]
    records = read_metrics(tmp_path / "rm")
    assert len(records) == 12 and "eval/accuracy" in records[5] and "rm/loss" in records[0]
    rm = RewardModel.load(str(tmp_path / "rm"), policy_tokenizer=tiny_tokenizer())
    conv = [{"role": "user", "content": "Task 99: write a word."}]
    good, bad = rm.score([render_conversation(rm.tokenizer, [*conv, {
        "role": "assistant", "content": reply}]) for reply in ("abba", "xyyx")]).tolist()
    assert good > bad  # a pair it never saw


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", count=12)
    every = ("--run.checkpoint_every", "2", "--reward.pair_batch_size", "4")
    train_reward_model(rm_config(data, tmp_path / "whole", 4, *every))
    train_reward_model(rm_config(data, tmp_path / "cut", 2, *every))
    resumed = train_reward_model(rm_config(data, tmp_path / "cut", 4, *every), resume=True)
    assert resumed.steps == 4 and len(read_metrics(tmp_path / "cut")) == 4
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    cut = load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)


def test_a_parquet_file_trains_with_the_held_out_loss_every_eval_every_steps(tmp_path):
    datasets = pytest.importorskip("datasets")  # an optional dependency, as for turnrl sft
    jsonl = write_pairs(tmp_path / "pairs.jsonl", count=8)
    datasets.Dataset.from_json(str(jsonl)).to_parquet(str(tmp_path / "pairs.parquet"))
    result = train_reward_model(rm_config(tmp_path / "pairs.parquet", tmp_path / "rm", 4,
                                          "--reward.eval_every", "2"))
    assert (result.train_pairs, result.held_out_pairs) == (6, 2)  # sft's split of 8
    records = read_metrics(tmp_path / "rm")
    assert ["eval/loss" in r for r in records] == [False, True, False, True]


def test_a_second_run_into_the_same_directory_is_refused(tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", count=8)
    train_reward_model(rm_config(data, tmp_path / "rm", 1))
    with pytest.raises(ConfigError, match="already holds a reward model; pass --resume"):
        train_reward_model(rm_config(data, tmp_path / "rm", 1))


@pytest.mark.parametrize("args, message", [
    ([], "turnrl rm needs --data FILE.jsonl"),
    (["--data", "missing.jsonl"], "reward.data 'missing.jsonl' is not a file"),
])
def test_the_command_fails_in_one_line(tmp_path, args, message):
    out = subprocess.run([sys.executable, "-m", "turnrl", "rm", *TINY_RM, *args],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode != 0
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1
