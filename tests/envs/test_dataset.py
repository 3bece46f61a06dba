"""``dataset`` (envs/dataset.py): every file format, real splits (no held-out seed ever draws a
training row), deterministic epochs, one-line errors, and a real training run."""

from __future__ import annotations

import asyncio
import csv
import json
from pathlib import Path

import pytest

from turnrl.envs import make_env
from turnrl.envs.dataset import DatasetError, held_out, row_order
from turnrl.selfplay.evaluation import evaluation_factories

ROWS = [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(60)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def prompts(env, seeds) -> set[str]:
    return {asyncio.run(env.reset(seed)) for seed in seeds}


def test_every_format_gives_the_same_rows_and_split(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = [write_jsonl(tmp_path / "d.jsonl", ROWS), tmp_path / "d.csv", tmp_path / "d.parquet",
             tmp_path / "saved"]
    with files[1].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["prompt", "answer"])
        writer.writeheader()
        writer.writerows(ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), files[2])
    datasets.Dataset.from_list(ROWS).save_to_disk(str(files[3]))
    splits = [(make_env("dataset", path=str(f)).rows, make_env("dataset", path=str(f),
                                                               split="eval").rows)
              for f in files]
    assert all(s == splits[0] for s in splits)
    train, held = splits[0]
    assert len(train) + len(held) == len(ROWS) and held  # a held-out share by hash


def test_no_held_out_seed_draws_a_training_row_and_the_hash_split_ignores_file_order(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    train = make_env("dataset", path=str(path))
    (label, build), = evaluation_factories("dataset", {"path": str(path)}, train).items()
    held = build()  # what evaluation plays: the eval split
    train_prompts = prompts(train, range(0, 3000, 7))
    eval_prompts = prompts(held, range(1_000_000, 1_000_500))
    assert train_prompts and eval_prompts and not train_prompts & eval_prompts
    assert eval_prompts == {r["prompt"] for r in ROWS if held_out(r, 0.1)}
    shuffled = write_jsonl(tmp_path / "reversed.jsonl", ROWS[::-1])
    assert {r["prompt"] for r in make_env("dataset", path=str(shuffled), split="eval").rows} \
        == eval_prompts


def test_training_seeds_walk_each_epoch_once_in_its_own_order():
    first = [row_order(seed, 10, 0) for seed in range(10)]
    second = [row_order(seed, 10, 0) for seed in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10))  # every row once an epoch
    assert first != second  # a fresh shuffle each epoch
    assert first == [row_order(seed, 10, 0) for seed in range(10)]  # the same on a resume
    assert first != [row_order(seed, 10, 1) for seed in range(10)]


def test_named_splits_win_over_the_hash(tmp_path):
    import datasets

    marked = [{**r, "split": "test" if i < 5 else "train"} for i, r in enumerate(ROWS)]
    path = write_jsonl(tmp_path / "marked.jsonl", marked)
    assert [r["answer"] for r in make_env("dataset", path=str(path), split="eval").rows] == \
        ["0", "2", "4", "6", "8"]
    other = write_jsonl(tmp_path / "eval.jsonl", ROWS[:3])
    every = write_jsonl(tmp_path / "all.jsonl", ROWS)
    assert len(make_env("dataset", path=str(every), eval_path=str(other)).rows) == len(ROWS)
    assert len(make_env("dataset", path=str(every), eval_path=str(other),
                        split="eval").rows) == 3
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:40]),
                               "test": datasets.Dataset.from_list(ROWS[40:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(make_env("dataset", path=str(tmp_path / "dd")).rows) == 40
    assert len(make_env("dataset", path=str(tmp_path / "dd"), split="eval").rows) == 20


def test_a_chat_column_gives_the_prompt_and_system_message_and_the_reward_reads_answers(
        tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Two plus two?"}], "answer": "4",
             "split": "train"}]
    env = make_env("dataset", path=str(write_jsonl(tmp_path / "chat.jsonl", rows + [
        {**rows[0], "split": "test"}])), reward="numeric_match", instruction="Answer: N")
    assert asyncio.run(env.reset(0)) == "Two plus two?\n\nAnswer: N"
    assert env.system_prompt == "Be brief."
    assert asyncio.run(env.step("Answer: 4.0")).reward == 1.0
    wrong = asyncio.run(env.step("Answer: 5"))
    assert wrong.reward == 0.0 and wrong.info == {"success": False, "answered": True}
    silent = asyncio.run(env.step("no idea"))
    assert silent.reward == 0.0 and silent.info["answered"] is False
    oracle = env.reference_player()
    assert asyncio.run(env.step(oracle.act(""))).info["success"]


@pytest.mark.parametrize("rows, options, says", [
    ([{"question": "q", "answer": "1"}], {}, "row 0: no 'prompt' text"),
    ([{"prompt": "q"}], {}, "no 'answer' value for reward exact_match"),
    ([{"prompt": "q", "answer": "seven"}], {"reward": "numeric_match"}, "is not a number"),
    ([{"prompt": "q", "answer": "1", "split": "train"}], {"split": "eval"}, "has no rows"),
    ([{"prompt": "q", "answer": "1"}], {"reward": "bleu"}, "reward 'bleu' is unknown"),
])
def test_bad_datasets_fail_in_one_line_naming_the_row_and_field(tmp_path, rows, options, says):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError, match=says) as info:
        make_env("dataset", path=str(path), **options)
    assert "\n" not in str(info.value)


def test_unreadable_files_fail_in_one_line(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"prompt": "q", "answer": "1"}\n{oops\n')
    with pytest.raises(DatasetError, match="broken.jsonl:2: not JSON"):
        make_env("dataset", path=str(tmp_path / "broken.jsonl"))
    with pytest.raises(DatasetError, match="does not exist"):
        make_env("dataset", path=str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DatasetError, match="unknown format '.txt'"):
        make_env("dataset", path=str(tmp_path / "d.txt"))


def test_a_dataset_trains_and_evaluates_on_its_eval_split(tmp_path, capsys):
    from turnrl.cli import main
    from turnrl.config import load_config
    from turnrl.trainer import train

    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = load_config(None, ["--model.name", "tiny", "--env.name", "dataset",
                             "--env.options.path", str(path), "--rollout.max_new_tokens", "4",
                             "--run.steps", "2", "--eval.episodes", "6", "--run.progress",
                             "false", "--run.tensorboard", "false",
                             "--run.out_dir", str(tmp_path / "run")])
    result = train(cfg)
    assert result.after.episodes == 6
    # what was played, read back from the run's files: training rows in training, eval rows
    # in evaluation
    numbers = {split: {int(r["answer"]) // 2 for r in make_env(
        "dataset", path=str(path), split=split).rows} for split in ("train", "eval")}
    played = {"train": asked(tmp_path / "run" / "episodes", "step-*.jsonl"),
              "eval": asked(tmp_path / "run", "eval_*.jsonl")}
    assert played["train"] and played["train"] <= numbers["train"]
    assert played["eval"] and played["eval"] <= numbers["eval"]
    assert main(["envs"]) == 0
    assert "dataset" in capsys.readouterr().out


def asked(directory: Path, pattern: str) -> set[int]:
    """The numbers of the prompts in the episode files ``pattern`` of ``directory``."""
    import re

    from turnrl.models import tiny_model

    _, tokenizer = tiny_model(seed=0)
    found = set()
    for file in directory.glob(pattern):
        for line in file.read_text().splitlines():
            episode = json.loads(line)
            first = episode["loss_mask"].index(1)
            text = tokenizer.decode(episode["token_ids"][:first])
            found |= {int(n) for n in re.findall(r"What is (\d+) plus", text)}
    return found
