"""The opponent pool in checkpoints (turnrl/selfplay/pool.py, turnrl/checkpoint.py ``frozen``): an
interrupted pool run resumes with the same frozen opponents and the same draws, bit for bit;
the members' weights are stored once; a checkpoint without a pool still resumes."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file

from turnrl.config import load_config
from turnrl.metrics import read_metrics
from turnrl.trainer import train
from turnrl.trainer.local import LocalSource

STEPS = 4


@pytest.fixture(scope="module")
def player(tmp_path_factory):
    """The tiny model after a short SFT warm-up on TicTacToe's scripted demonstrations: it
    names cells, so pool opponents make legal moves and what they play changes the policy's
    games (the random tiny model forfeits every game on its first reply, whoever it faces)."""
    from turnrl.sft.train import sft

    out = tmp_path_factory.mktemp("warmup")
    sft(load_config(None, [
        "--model.name", "tiny", "--env.name", "tictactoe", "--env.options.opponent", "random",
        "--sft.env_demos", "16", "--sft.eval_fraction", "0", "--run.steps", "10",
        "--optim.lr", "3e-2", "--run.out_dir", str(out), "--run.progress", "false",
        "--run.tensorboard", "false"]))
    return out / "checkpoints" / "step-000010"


def _cfg(model, out, steps=STEPS, *extra):
    return load_config(None, [*extra,
        "--model.name", str(model), "--env.name", "tictactoe", "--env.options.opponent",
        "pool", "--env.opponent_pool_size", "3", "--env.opponent_pool_every", "1",
        "--rollout.max_new_tokens", "3", "--rollout.group_size", "2",
        "--rollout.groups_per_step", "2", "--optim.lr", "1e-2", "--eval.episodes", "0",
        "--run.steps", str(steps), "--run.checkpoint_every", "2", "--run.keep_checkpoints", "2",
        "--run.progress", "false", "--run.tensorboard", "false", "--run.out_dir", str(out)])


def _weights(run_dir, step, name="", file="model.safetensors"):
    folder = run_dir / "checkpoints" / f"step-{step:06d}" / name
    return load_file(folder / file)


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _opponents(run_dir):
    """Per step: how many games each pool version played, and how long the games were."""
    return [{k: v for k, v in row.items()
             if k.startswith("game/opponent/") or k in ("game/pool_versions", "episode/turns")}
            for row in read_metrics(run_dir / "metrics.jsonl")]


def _interrupted(cfg, monkeypatch, at_step):
    """``cfg``'s run, stopped as a kill would during step ``at_step`` (0-based)."""
    collect = LocalSource.collect

    def interrupted(self, step):
        if step == at_step:
            raise KeyboardInterrupt
        return collect(self, step)
    with monkeypatch.context() as patch:
        patch.setattr(LocalSource, "collect", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)


@pytest.fixture(scope="module")
def straight(player, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train(_cfg(player, out))
    return out


def test_an_interrupted_pool_run_resumes_with_the_same_pool_bit_for_bit(
        player, straight, tmp_path, monkeypatch):
    cut = tmp_path / "cut"  # killed during the last step, after step 2's checkpoint
    _interrupted(_cfg(player, cut), monkeypatch, at_step=STEPS - 1)
    saved = json.loads((cut / "checkpoints" / "step-000002" / "state.json").read_text())
    assert saved["opponent_pool"] == {"versions": [0, 1, 2], "draws": 8}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a resume with its pool warns of nothing
        train(_cfg(player, cut), resume=True)  # redoes step 3, then step 4

    # the pool's games: the same versions drawn, step by step, in games that were played out
    played = _opponents(straight)
    assert _opponents(cut) == played
    assert any(row["episode/turns"] > 1 for row in played)  # opponents moved legally
    assert {k for row in played for k in row if k.startswith("game/opponent/")} \
        >= {"game/opponent/pool-v1", "game/opponent/pool-v2", "game/opponent/pool-v3"}
    # the weights, and the pool each run ends with
    assert _equal(_weights(cut, STEPS), _weights(straight, STEPS))
    final = json.loads((cut / "checkpoints" / f"step-{STEPS:06d}" / "state.json").read_text())
    assert final["opponent_pool"]["versions"] == [2, 3, 4]
    for version in (2, 3, 4):
        name = f"opponent_pool/v{version:06d}"
        assert _equal(_weights(cut, STEPS, name), _weights(straight, STEPS, name))
    assert not _equal(_weights(cut, STEPS, "opponent_pool/v000002"), _weights(cut, STEPS))


def test_a_lora_pool_run_resumes_bit_for_bit_with_the_adapters_in_its_pool(
        player, tmp_path, monkeypatch):
    """LoRA: a pool member is the frozen base with its version's adapter; the checkpoint
    holds each version's adapter only (the base is the run's model)."""
    lora = ("--model.lora.r", "4")
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train(_cfg(player, straight, STEPS, *lora))
    _interrupted(_cfg(player, cut, STEPS, *lora), monkeypatch, at_step=STEPS - 1)
    train(_cfg(player, cut, STEPS, *lora), resume=True)
    assert _opponents(cut) == _opponents(straight)
    adapter = "adapter_model.safetensors"
    for name in ("", "opponent_pool/v000002", "opponent_pool/v000003", "opponent_pool/v000004"):
        assert _equal(_weights(cut, STEPS, name, adapter), _weights(straight, STEPS, name, adapter))
    assert not (cut / "checkpoints" / "step-000004" / "opponent_pool" / "v000003" /
                "model.safetensors").exists()
    assert not _equal(_weights(cut, STEPS, "opponent_pool/v000002", adapter),
                      _weights(cut, STEPS, "", adapter))


def test_pool_members_are_stored_once_across_checkpoints(straight):
    """Step 2 holds versions 0-2 (2 is the model itself), step 4 versions 2-4 (2 from step 2,
    4 the model): five weight sets, each written once, linked wherever else it is."""
    root = straight / "checkpoints"
    files = sorted(root.glob("step-*/**/model.safetensors"))
    assert len(files) == 8
    assert len({f.stat().st_ino for f in files}) == 5
    inode = lambda path: (root / path / "model.safetensors").stat().st_ino  # noqa: E731
    assert inode("step-000002/opponent_pool/v000002") == inode("step-000002")
    assert inode("step-000004/opponent_pool/v000002") == inode("step-000002")
    assert inode("step-000004/opponent_pool/v000004") == inode("step-000004")
    assert len({inode(f"step-000002/opponent_pool/v00000{v}") for v in (0, 1, 2)}) == 3


def test_a_checkpoint_without_a_pool_resumes_with_a_new_pool_and_one_warning(
        player, straight, tmp_path):
    """As a checkpoint written before pools were saved: the run resumes, its pool rebuilt from
    the resumed weights, and says so once; its opponents then differ from the straight run's
    (which is why the pool is saved)."""
    old = tmp_path / "old"
    train(_cfg(player, old, steps=2))
    checkpoint = old / "checkpoints" / "step-000002"
    state = json.loads((checkpoint / "state.json").read_text())
    del state["opponent_pool"]
    del state["files"]  # nor did it list its files' checksums (those came later still)
    (checkpoint / "state.json").write_text(json.dumps(state))
    shutil.rmtree(checkpoint / "opponent_pool")
    with pytest.warns(UserWarning) as caught:
        train(_cfg(player, old), resume=True)
    pool_warnings = [str(w.message) for w in caught if "opponent pool" in str(w.message)]
    assert len(pool_warnings) == 1 and "\n" not in pool_warnings[0]
    assert "has no opponent pool" in pool_warnings[0] and "step 2" in pool_warnings[0]
    rows = read_metrics(old / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["game/pool_versions"] == 2.0  # versions 2 and 3, not 1-3
    assert _opponents(old)[2:] != _opponents(straight)[2:]
    assert not _equal(_weights(old, STEPS), _weights(straight, STEPS))


def test_a_checkpoint_missing_a_pool_members_weights_is_refused_in_one_line(
        player, straight, tmp_path, capsys):
    from turnrl.cli import main

    torn = tmp_path / "torn"
    shutil.copytree(straight, torn)
    config = torn / "config.yaml"  # the copy is a run of its own
    config.write_text(config.read_text().replace(str(straight), str(torn)))
    shutil.rmtree(torn / "checkpoints" / "step-000004" / "opponent_pool" / "v000003")
    code = main(["train", "--resume", "--run.out_dir", str(torn), "--run.steps", "6"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    # state.json lists the member's files: caught before anything is loaded
    assert "opponent_pool/v000003/model.safetensors is missing" in err
    assert "step-000004" in err and "move it aside" in err


def _mix_cfg(model, out, steps=STEPS):
    return load_config(None, [
        "--model.name", str(model), "--env.name", "mix", "--env.mix",
        "[{name: tictactoe, options: {opponent: pool, role: both}, label: ttt}, "
        "{name: guess-number}]",
        "--env.opponent_pool_size", "3", "--env.opponent_pool_every", "1",
        "--rollout.max_new_tokens", "3", "--rollout.group_size", "2",
        "--rollout.groups_per_step", "4", "--optim.lr", "1e-2", "--eval.episodes", "0",
        "--run.steps", str(steps), "--run.checkpoint_every", "2", "--run.keep_checkpoints", "2",
        "--run.progress", "false", "--run.tensorboard", "false", "--run.out_dir", str(out)])


def test_a_pool_inside_a_mix_resumes_bit_for_bit(player, tmp_path, monkeypatch):
    """A mix entry playing the pool keeps its pool across a kill as a plain pool run does:
    the same versions drawn for the mix's games after the resume, the same weights."""
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train(_mix_cfg(player, straight))
    _interrupted(_mix_cfg(player, cut), monkeypatch, at_step=STEPS - 1)
    saved = json.loads((cut / "checkpoints" / "step-000002" / "state.json").read_text())
    assert saved["opponent_pool"]["versions"] == [0, 1, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(_mix_cfg(player, cut), resume=True)
    played = _opponents(straight)
    assert _opponents(cut) == played
    assert {k for row in played for k in row if k.startswith("game/opponent/pool-v")}
    assert _equal(_weights(cut, STEPS), _weights(straight, STEPS))
    for version in (2, 3, 4):
        name = f"opponent_pool/v{version:06d}"
        assert _equal(_weights(cut, STEPS, name), _weights(straight, STEPS, name))
