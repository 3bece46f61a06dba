"""Preference pairs: the Bradley-Terry loss by hand, the reader's formats and one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from turnrl.demos.data import DataError
from turnrl.sft.preference import bradley_terry_loss, parse_pair, read_pairs


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    # -log sigmoid(d) = log(1 + exp(-d)) for d = 1, 0, -2
    expected = (math.log1p(math.exp(-1)) + math.log(2) + math.log1p(math.exp(2))) / 3
    assert float(bradley_terry_loss(chosen, rejected)) == pytest.approx(expected, rel=1e-6)
    # a wide, right margin costs almost nothing; a wrong one grows linearly
    assert float(bradley_terry_loss(torch.tensor([20.0]), torch.tensor([0.0]))) < 1e-8
    assert float(bradley_terry_loss(torch.tensor([0.0]), torch.tensor([20.0]))) == \
        pytest.approx(20.0, rel=1e-6)


def test_pair_formats():
    text = parse_pair({"prompt": "hi", "chosen": "good", "rejected": "bad"}, "f:1")
    assert text.chosen == [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "good"}]
    assert text.rejected[-1] == {"role": "assistant", "content": "bad"}
    conv = [{"role": "user", "content": "hi"}]
    whole = parse_pair({"chosen": [*conv, {"role": "assistant", "content": "a"}],
                        "rejected": [*conv, {"role": "assistant", "content": "b"}]}, "f:2")
    assert [m["content"] for m in whole.chosen] == ["hi", "a"]


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "p", "chosen": "a"}, "f.jsonl:1: rejected: missing"),
    ({"prompt": "p", "chosen": "a", "rejected": "a"}, "chosen and rejected are the same"),
    ({"prompt": "p", "chosen": 3, "rejected": "a"}, "f.jsonl:1: chosen: must be a text"),
    ({"chosen": [{"role": "robot", "content": "x"}], "rejected": "a"},
     "chosen[0].role: 'robot' is not one of"),
    ([1, 2], "a row must be a JSON object"),
])
def test_bad_rows_fail_in_one_line(tmp_path, row, problem):
    path = tmp_path / "f.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError) as err:
        read_pairs(path)
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="is not a file"):
        read_pairs(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no preference pairs"):
        read_pairs(tmp_path / "empty.jsonl")


# ---- local Hugging Face datasets, read by turnrl sft's reader -------------------------------

def test_pairs_read_the_same_from_jsonl_parquet_arrow_and_a_saved_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")  # an optional dependency
    turn = [{"role": "user", "content": "Hi"}]
    rows = [{"prompt": "What is 12 + 30?", "chosen": "42", "rejected": "41"},
            {"prompt": "Name a colour.", "chosen": "Red.", "rejected": "Seven."}]
    whole = [{"chosen": [*turn, {"role": "assistant", "content": "Hello."}],
              "rejected": [*turn, {"role": "assistant", "content": "Go away."}]}]
    for name, group in (("text", rows), ("whole", whole)):
        jsonl = tmp_path / f"{name}.jsonl"
        jsonl.write_text("".join(json.dumps(row) + "\n" for row in group))
        expected = [(p.chosen, p.rejected) for p in read_pairs(jsonl)]
        table = datasets.Dataset.from_list(group)
        table.to_parquet(str(tmp_path / f"{name}.parquet"))
        table.save_to_disk(str(tmp_path / f"{name}-saved"))
        arrow = next((tmp_path / f"{name}-saved").glob("*.arrow"))  # the saved table itself
        datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / f"{name}-splits"))
        for path in (f"{name}.parquet", arrow, f"{name}-saved", f"{name}-splits"):
            got = read_pairs(tmp_path / path)
            assert [(p.chosen, p.rejected) for p in got] == expected, path
            assert got[-1].where == f"{tmp_path / path}: row {len(group)}"


def test_a_bad_row_of_a_dataset_names_its_row(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"},
            {"prompt": "q", "chosen": "c", "rejected": None}]  # Arrow's null: the key is gone
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError) as err:
        read_pairs(tmp_path / "bad.parquet")
    assert str(err.value).startswith(f"{tmp_path / 'bad.parquet'}: row 2: rejected: missing; ")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="reward.data '.*junk.parquet': cannot be read as a "):
        read_pairs(tmp_path / "junk.parquet")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(
        str(tmp_path / "test-only"))
    with pytest.raises(DataError, match="reward.data .*no 'train' split \\(it has test\\)"):
        read_pairs(tmp_path / "test-only")
