"""Seeded fuzz of the checkpoint boundary: a checkpoint directory with a file truncated at a
random byte, deleted, or overwritten with random bytes, or a ``state.json`` from another
version or missing its keys, is refused with one line naming the checkpoint and the fix
(``CheckpointError``): never a traceback, and never weights loaded from bad bytes (the model
and optimiser are untouched). Resuming such a run through the command fails the same way."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from turnrl.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    load_component,
    rng_state,
    save_checkpoint,
)
from turnrl.cli import main
from turnrl.models import tiny_model

CASES = 24
"""Random corruptions per fuzz test."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A whole checkpoint of the tiny model after one optimiser step, with a component and a
    frozen copy (an opponent pool member), as a run writes it."""
    model, _ = tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    frozen, _ = tiny_model(seed=1)
    run_dir = tmp_path_factory.mktemp("run")
    return save_checkpoint(run_dir, 3, model, optimizer, rng=rng_state(),
                           components={"estimator": {"baselines": {"a": 0.5}}},
                           frozen={"opponent_pool/v000001": frozen})


def _fresh():
    model, _ = tiny_model(seed=7)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _copy(saved, tmp_path):
    path = tmp_path / "run" / "checkpoints" / saved.name
    shutil.copytree(saved, path)
    return path


def _corrupt(path, rng: random.Random) -> str:
    """Damage one file of the checkpoint at ``path`` as ``rng`` draws; what was done."""
    files = sorted(f for f in path.rglob("*") if f.is_file())
    file = rng.choice(files)
    data = file.read_bytes()
    how = rng.choice(["truncate", "delete", "garbage"])
    if how == "delete":
        file.unlink()
    elif how == "truncate":
        file.write_bytes(data[:rng.randrange(len(data))])
    else:  # same size, some bytes replaced: only a checksum can tell
        start = rng.randrange(len(data))
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        junk = junk[:len(data) - start]
        if junk == data[start:start + len(junk)]:
            junk = bytes(b ^ 0xFF for b in junk)
        file.write_bytes(data[:start] + junk + data[start + len(junk):])
    return f"{how} {file.relative_to(path)}"


def _refused_in_one_line(path, load):
    with pytest.raises(CheckpointError) as caught:
        load()
    message = str(caught.value)
    assert "\n" not in message and len(message) < 1000, message
    assert f"checkpoint '{path}'" in message and "move it aside" in message, message
    return message


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_whole_checkpoint_loads_and_lists_its_files(saved):
    model, optimizer = _fresh()
    state, rng = load_checkpoint(saved, model, optimizer)
    assert state["step"] == 3 and set(rng) >= {"python", "numpy", "torch"}
    assert {"model.safetensors", "optimizer.pt", "rng.pt", "estimator.pt",
            "opponent_pool/v000001/model.safetensors"} <= set(state["files"])
    assert load_component(saved, "estimator") == {"baselines": {"a": 0.5}}


@pytest.mark.parametrize("seed", range(CASES))
def test_a_damaged_checkpoint_is_refused_before_anything_is_loaded(saved, tmp_path, seed):
    path = _copy(saved, tmp_path)
    how = _corrupt(path, random.Random(seed))
    model, optimizer = _fresh()
    before = _state(model)
    message = _refused_in_one_line(path, lambda: load_checkpoint(path, model, optimizer))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items()), how
    assert not optimizer.state, how  # nothing loaded from the bad bytes
    if how.startswith("delete") and not how.endswith("state.json"):
        assert f"{how.split()[1]} is missing" in message


@pytest.mark.parametrize("seed", range(CASES // 2))
def test_a_checkpoint_without_checksums_truncated_or_missing_a_file_is_refused(saved, tmp_path,
                                                                               seed):
    """A checkpoint written before state.json listed its files: truncation and deletion are
    still caught, by the loaders' own errors, named in one line."""
    path = _copy(saved, tmp_path)
    state = json.loads((path / "state.json").read_text())
    del state["files"]
    (path / "state.json").write_text(json.dumps(state))
    rng = random.Random(seed)
    file = rng.choice(["model.safetensors", "optimizer.pt", "rng.pt"])
    data = (path / file).read_bytes()
    if rng.random() < 0.3:
        (path / file).unlink()
    else:
        (path / file).write_bytes(data[:rng.randrange(len(data))])
    model, optimizer = _fresh()
    message = _refused_in_one_line(path, lambda: load_checkpoint(path, model, optimizer))
    assert file in message


@pytest.mark.parametrize("state", [
    b"", b"\xff\xfe garbage", b'{"step": 3', b"[]", b"{}", b'{"step": "3"}', b'{"step": -1}',
    b'{"step": true}', b'{"version": 9, "global_step": 3}', b'{"step": 3, "files": "all"}',
    b'{"step": 3, "files": {"model.safetensors": [1, 2]}}',
    b'{"step": 3, "files": {"gone.pt": [1, 2]}}',
])
def test_a_state_json_from_another_version_or_missing_keys_is_refused(saved, tmp_path, state):
    path = _copy(saved, tmp_path)
    (path / "state.json").write_bytes(state)
    model, optimizer = _fresh()
    message = _refused_in_one_line(path, lambda: load_checkpoint(path, model, optimizer))
    assert "state.json" in message or "is missing" in message or "is not the file" in message


def test_weights_of_another_model_are_refused_in_one_line(saved, tmp_path):
    path = _copy(saved, tmp_path)
    state = json.loads((path / "state.json").read_text())
    del state["files"]  # as a checkpoint of this version would list them
    (path / "state.json").write_text(json.dumps(state))
    other, _ = tiny_model(seed=0, hidden_size=128)
    message = _refused_in_one_line(
        path, lambda: load_checkpoint(path, other, torch.optim.AdamW(other.parameters())))
    assert "model.safetensors could not be loaded" in message


def test_a_set_aside_checkpoint_is_not_picked_as_the_latest(saved, tmp_path):
    path = _copy(saved, tmp_path)
    shutil.copytree(path, path.with_name(f"{path.name}.bad"))
    assert latest_checkpoint(tmp_path / "run") == path


TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.progress", "false", "--run.tensorboard", "false", "--run.steps", "1",
        "--eval.episodes", "2", "--rollout.groups_per_step", "1", "--rollout.group_size", "2"]


def test_resuming_a_run_whose_checkpoint_is_damaged_fails_in_one_line(tmp_path, capsys):
    run = TINY + ["--run.out_dir", str(tmp_path)]
    assert main(["train", *run]) == 0
    checkpoint = latest_checkpoint(tmp_path)
    data = (checkpoint / "model.safetensors").read_bytes()
    (checkpoint / "model.safetensors").write_bytes(data[:len(data) // 2])
    capsys.readouterr()
    assert main(["train", "--resume", "--run.out_dir", str(tmp_path), "--run.steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert f"checkpoint '{checkpoint}' cannot be used: model.safetensors" in err
    assert "move it aside" in err
    (tmp_path / "config.yaml").write_bytes(b"model: [\xff")
    assert main(["train", "--resume", "--run.out_dir", str(tmp_path), "--run.steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "config.yaml:1: byte 0xff" in err, err  # its line named
