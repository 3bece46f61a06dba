"""``dataset`` (envs/dataset.py): every file format, real splits (no held-out seed ever draws a
training row), deterministic epochs, one-line errors, and a real training run."""

from __future__ import annotations

import asyncio
import csv
import functools
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


GOOD = {"prompt": "q", "answer": "1", "tests": ["assert True"], "level": 1}


def write_rows(path: Path, rows: list[dict]) -> Path:
    """``rows`` as the file ``path``'s suffix says (CSV cells are text: a list as JSON)."""
    if path.suffix == ".jsonl":
        return write_jsonl(path, rows)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    if path.suffix == ".csv":
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields)
            writer.writeheader()
            writer.writerows({k: json.dumps(v) if isinstance(v, list) else v
                              for k, v in row.items()} for row in rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([{f: row.get(f) for f in fields} for row in rows]),
                       path)
    return path


@pytest.mark.parametrize("file, rows, options, says", [
    ("bad.jsonl", [GOOD, {"question": "q", "answer": "1"}], {}, r"bad.jsonl:2: no 'prompt' text"),
    ("bad.jsonl", [GOOD, {"prompt": "q"}], {},
     "bad.jsonl:2: no 'answer' value for reward exact_match"),
    ("bad.jsonl", [GOOD, {**GOOD, "answer": "seven"}], {"reward": "numeric_match"},
     "bad.jsonl:2: answer 'seven' is not a number"),
    ("bad.jsonl", [GOOD, {**GOOD, "answer": "\\boxed{}"}], {"reward": "math_answer"},
     r"bad.jsonl:2: answer .* does not parse as math"),
    ("bad.jsonl", [GOOD, {**GOOD, "tests": "assert f(1) == 2"}], {"reward": "code_tests"},
     "bad.jsonl:2: tests .* is not a list of test strings"),
    ("bad.csv", [GOOD, {**GOOD, "tests": "assert f(1) == 2"}], {"reward": "code_tests"},
     "bad.csv:3: tests .* is not a list of test strings"),  # line 1: the header
    ("bad.csv", [{**GOOD, "prompt": "two\nlines"}, {**GOOD, "answer": ""}], {},
     "bad.csv:4: no 'answer'"),  # the line a record starts on, past a quoted line break
    ("bad.parquet", [GOOD, {**GOOD, "answer": ""}], {}, "bad.parquet: row 2: no 'answer'"),
    ("bad.jsonl", [GOOD, {"prompt": "q", "answer": "1"}], {"metadata": "level"},
     "bad.jsonl:2: no 'level' column, which --env.options.metadata names"),
    # the file's line, not the row's index within its split (0 in the train split here)
    ("bad.jsonl", [{**GOOD, "split": "test"}, {**GOOD, "split": "test"},
                   {"prompt": "q", "split": "train"}], {}, "bad.jsonl:3: no 'answer'"),
    ("bad.jsonl", [{**GOOD, "split": "train"}], {"split": "eval"}, "has no rows"),
    ("bad.jsonl", [GOOD], {"reward": "bleu"}, "reward 'bleu' is unknown"),
    ("bad.jsonl", [GOOD], {"metadata": {"a": 1}}, "metadata .* name columns"),
])
def test_bad_datasets_fail_in_one_line_naming_the_row_and_field(tmp_path, file, rows, options,
                                                                 says):
    path = write_rows(tmp_path / file, rows)
    with pytest.raises(DatasetError, match=says) as info:
        make_env("dataset", path=str(path), **options)
    assert "\n" not in str(info.value)


def test_a_csv_cell_holding_a_json_list_of_tests_is_read_as_that_list(tmp_path):
    tests = ["assert f(1) == 2", "assert f(2) == 3"]
    path = write_rows(tmp_path / "code.csv", [{"prompt": "Write f(x) = x + 1.",
                                               "tests": tests}] * 2)
    env = make_env("dataset", path=str(path), reward="code_tests", eval_fraction=0.01)
    asyncio.run(env.reset(0))
    step = asyncio.run(env.step("```python\ndef f(x):\n    return x + 1\n```"))
    assert step.reward == 1.0 and step.info["success"]  # 2 tests, not 32 one-character ones


def test_reward_none_needs_no_answer_reports_no_success_and_passes_metadata_on(tmp_path):
    rows = [{"prompt": f"Write about {i}.", "meta": {"topic": i, "style": "haiku"},
             "source": "web"} for i in range(20)]
    path = write_jsonl(tmp_path / "open.jsonl", rows)  # no answer column at all
    env = make_env("dataset", path=str(path), reward="none", metadata="meta")
    prompt = asyncio.run(env.reset(0))
    step = asyncio.run(env.step("Anything."))
    row = next(r for r in rows if r["prompt"] == prompt)
    assert step.reward == 0.0 and step.done and "success" not in step.info
    assert step.info["metadata"] == row["meta"] == env.metadata  # a dict column: its keys
    assert step.info["judge_reference"] == f"topic: {row['meta']['topic']}; style: haiku"
    named = make_env("dataset", path=str(path), reward="judge", metadata=["source"])
    asyncio.run(named.reset(0))
    assert asyncio.run(named.step("x")).info["metadata"] == {"source": "web"}
    checked = make_env("dataset", path=str(write_jsonl(tmp_path / "a.jsonl", ROWS)),
                       metadata="answer")
    asyncio.run(checked.reset(0))
    assert set(asyncio.run(checked.step("x")).info) == {"success", "answered", "metadata",
                                                        "judge_reference"}


@pytest.mark.parametrize("args, says", [
    (["--env.options.reward", "none"], "neither is set: pass --judge.model"),
    (["--env.options.reward", "judge"], "the judge section, which is off"),
    (["--env.options.reward", "model", "--judge.model", "tiny", "--judge.rubric", "r"],
     "reward.model is unset: pass --reward.model DIR"),
    (["--env.options.reward", "none", "--judge.model", "tiny", "--judge.rubric", "r"],
     "held-out evaluation is not judged.*pass --eval.episodes 0"),
    (["--env.name", "try-again", "--env.options.inner", "dataset", "--env.options.reward",
      "judge", "--judge.model", "tiny", "--judge.rubric", "r"], "drop the wrapper"),
])
def test_a_reward_left_to_the_trainer_needs_a_judge_or_reward_model_and_no_evaluation(
        args, says):
    from turnrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=says) as info:
        load_config(None, ["--env.name", "dataset", "--env.options.path", "d.jsonl", *args])
    assert "\n" not in str(info.value)
    load_config(None, ["--env.name", "dataset", "--env.options.reward", "none", "--judge.model",
                       "tiny", "--judge.rubric", "r", "--eval.episodes", "0"])


def test_try_again_around_a_dataset_plays_its_held_out_split_in_evaluation(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    options = {"inner": "dataset", "path": str(path), "reward": "numeric_match"}
    train = make_env("try-again", **options)
    (label, build), = evaluation_factories("try-again", options, train).items()
    held = build()
    assert label == "try-again" and held.env.split == "eval"
    assert held.env.rows == make_env("dataset", path=str(path), split="eval").rows
    eval_prompts = {r["prompt"] for r in held.env.rows}
    assert prompts(held, range(1_000_000, 1_000_200)) == eval_prompts
    assert not prompts(train, range(0, 600, 7)) & eval_prompts
    question = asyncio.run(held.reset(1_000_000))
    answer = next(r["answer"] for r in ROWS if r["prompt"] == question)
    wrong = asyncio.run(held.step("Answer: -1"))
    assert (wrong.observation, wrong.reward, wrong.done) == ("Let's try again.", 0.0, False)
    right = asyncio.run(held.step(f"Answer: {answer}"))
    assert right.done and right.info["success"] and right.reward == pytest.approx(0.9)


def tiny_run(path: Path, out: Path, *extra: str) -> list[str]:
    return ["--model.name", "tiny", "--env.name", "dataset", "--env.options.path", str(path),
            "--rollout.max_new_tokens", "4", "--rollout.group_size", "2",
            "--rollout.groups_per_step", "3", "--run.sample_episodes", "6", "--run.progress",
            "false", "--run.tensorboard", "false", "--run.out_dir", str(out), *extra]


def test_a_resumed_dataset_run_plays_the_rows_the_uninterrupted_one_played(tmp_path):
    from turnrl.config import load_config
    from turnrl.metrics import read_metrics
    from turnrl.trainer import train

    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    run = ("--eval.episodes", "0", "--run.checkpoint_every", "0")
    train(load_config(None, tiny_run(path, tmp_path / "straight", "--run.steps", "3", *run)))
    train(load_config(None, tiny_run(path, tmp_path / "cut", "--run.steps", "2", *run)))
    train(load_config(None, tiny_run(path, tmp_path / "cut", "--run.steps", "3", *run)),
          resume=True)
    played = {name: [played_in(tmp_path / name / "episodes" / f"step-{step:06d}.jsonl")
                     for step in (1, 2, 3)] for name in ("straight", "cut")}
    assert played["cut"] == played["straight"]
    assert [r["step"] for r in read_metrics(tmp_path / "cut" / "metrics.jsonl")] == [1, 2, 3]
    assert all(len(set(step)) == 3 for step in played["straight"])  # 3 rows a step
    assert len({n for step in played["straight"] for n in step}) == 9  # none twice in epoch 0


def test_an_answerless_dataset_trains_on_the_judges_scores(tmp_path):
    """reward judge, rows with no answer: the judge (an HTTP endpoint) is told each row's
    metadata and scores by it; its score is the episode's reward, the env's being 0."""
    import re

    from tests.helpers.judge_server import ChatServer
    from turnrl.config import load_config
    from turnrl.trainer import train

    def judge(body: dict) -> str:  # topic N scores N of 10; the prompt never shows N
        return json.dumps({"score": int(re.search(r"topic: (\d+)",
                                                  body["messages"][0]["content"]).group(1))})

    rows = [{"prompt": f"What is {i} plus {i}?", "topic": (3 * i) % 11} for i in range(40)]
    path = write_jsonl(tmp_path / "open.jsonl", rows)
    server = ChatServer(judge)
    try:
        train(load_config(None, tiny_run(
            path, tmp_path / "run", "--env.options.reward", "judge", "--env.options.metadata",
            "topic", "--judge.base_url", server.base_url, "--judge.model", "m",
            "--judge.rubric", "Score the reply.", "--run.steps", "2", "--eval.episodes", "0")))
    finally:
        server.close()
    episodes = [json.loads(line) for file in sorted((tmp_path / "run" / "episodes").glob("*"))
                for line in file.read_text().splitlines()]
    assert len(episodes) == 12 and len(server.requests) >= 6
    for episode in episodes:
        (number,) = played_in_episode(episode)
        assert episode["reward"] == pytest.approx(rows[number]["topic"] / 10)
        assert episode["info"]["judge_score"] == pytest.approx(episode["reward"])
        assert episode["info"]["metadata"] == {"topic": rows[number]["topic"]}


def test_unreadable_files_fail_in_one_line(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"prompt": "q", "answer": "1"}\n{oops\n')
    with pytest.raises(DatasetError, match="broken.jsonl:2: not valid JSON"):
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
    return {n for file in directory.glob(pattern) for n in played_in(file)}


def played_in(file: Path) -> list[int]:
    """The prompts' numbers of the episode file ``file``, in its order."""
    return [n for line in file.read_text().splitlines()
            for n in played_in_episode(json.loads(line))]


def played_in_episode(episode: dict) -> list[int]:
    """The numbers in an episode's prompt ("What is N plus N?"), decoded from its tokens."""
    import re

    first = episode["loss_mask"].index(1)
    return [int(n) for n in re.findall(r"What is (\d+) plus", tiny_tokenizer().decode(
        episode["token_ids"][:first]))]


@functools.cache
def tiny_tokenizer():
    from turnrl.models import tiny_model

    return tiny_model(seed=0)[1]
