"""Sharded checkpoints (torch.distributed.checkpoint) on real gloo process groups: written by 2
ranks (fsdp, ddp, LoRA), read back at 1, 2 and 3 ranks, into either strategy, with weights and
AdamW moments equal to what the writers held; today's one-process checkpoints load into
sharded models; ``turnrl export`` and ``turnrl serve`` read a sharded checkpoint; a damaged
shard is one line.

The ranks run once for the whole module (``written``): two spawns, one of 2 ranks and one of 3,
each doing several saves and loads in order (tests/learner/checkpoint_ranks.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.learner.checkpoint_ranks import load, run_ranks, train_save
from turnrl.checkpoint import (
    CheckpointError,
    holds_adapter,
    is_checkpoint,
    load_checkpoint,
    load_weights,
    read_state,
    rng_state,
    save_checkpoint,
)
from turnrl.config import load_config
from turnrl.config.load import save_config
from turnrl.learner.checkpoints import (
    full_weights,
    is_sharded_checkpoint,
    save_sharded,
    saved_model_keys,
)
from turnrl.models import tiny_model

STEP = "checkpoints/step-000002"
SPAWN_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """Checkpoints of every kind and the whole state each load left, under one directory:
    ``<run>/`` (a run with its checkpoint), ``<run>.pt`` (what the writers held),
    ``<run>@<world>-<strategy>.pt`` (what the readers hold after loading it)."""
    root = tmp_path_factory.mktemp("dcp")
    for lora in (False, True):  # today's format, written by one process
        name = "today-lora" if lora else "today"
        train_save(None, "plain", lora, str(root / name), str(root / f"{name}.pt"))
    lora = ["--model.lora.r", "4", "--model.lora.alpha", "8",
            "--model.lora.target_modules", "q_proj,v_proj"]  # checkpoint_ranks.LORA
    for run, more in (("fsdp", []), ("lora", lora)):  # the run configs export reads
        save_config(load_config(None, ["--model.name", "tiny", "--run.out_dir",
                                       str(root / run), *more]), root / run / "config.yaml")

    def loads(run: str, strategy: str, world: int, lora: bool = False) -> tuple:
        return ("load", strategy, lora, str(root / run / STEP),
                str(root / f"{run}@{world}-{strategy}.pt"))

    run_ranks(2, [("train_save", "fsdp", False, str(root / "fsdp"), str(root / "fsdp.pt")),
                  ("train_save", "ddp", False, str(root / "ddp"), str(root / "ddp.pt")),
                  ("train_save", "fsdp", True, str(root / "lora"), str(root / "lora.pt")),
                  loads("fsdp", "fsdp", 2), loads("fsdp", "ddp", 2), loads("ddp", "fsdp", 2),
                  loads("today", "fsdp", 2), loads("today", "ddp", 2),
                  loads("today-lora", "fsdp", 2, lora=True)],
              root / "errors-2", SPAWN_TIMEOUT_S)
    run_ranks(3, [loads("fsdp", "fsdp", 3), loads("ddp", "ddp", 3), loads("ddp", "fsdp", 3)],
              root / "errors-3", SPAWN_TIMEOUT_S)
    return root


def _read(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def assert_same_state(got: dict, expected: dict) -> None:
    """Weights and AdamW state (moments, step, hyperparameters) bit-equal, by name."""
    assert got["model"].keys() == expected["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    assert got["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys()
    assert expected["optimizer"]["state"], "the writers' optimiser had no state"
    for name, moments in expected["optimizer"]["state"].items():
        assert moments.keys() == got["optimizer"]["state"][name].keys()
        for key, value in moments.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][name][key]),
                               torch.as_tensor(value)), (name, key)
    assert got["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]


def test_two_ranks_write_a_dcp_directory_that_the_manifest_covers(written):
    for run in ("fsdp", "ddp", "lora"):
        path = written / run / STEP
        names = {p.name for p in path.iterdir()}
        assert {".metadata", "__0_0.distcp", "state.json", "rng.pt"} <= names, names
        assert not names & {"model.safetensors", "optimizer.pt", "adapter_model.safetensors"}
        assert is_sharded_checkpoint(path) and is_checkpoint(path)
        listed = set(read_state(path)["files"])
        assert {n for n in names if n != "state.json"} == listed
    assert not list((written / "fsdp" / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize(("run", "world", "strategy"), [
    ("fsdp", 2, "fsdp"), ("fsdp", 2, "ddp"), ("ddp", 2, "fsdp"),
    ("fsdp", 3, "fsdp"), ("ddp", 3, "ddp"), ("ddp", 3, "fsdp"),
    ("today", 2, "fsdp"), ("today", 2, "ddp"), ("today-lora", 2, "fsdp")])
def test_a_checkpoint_loads_resharded_at_another_world_size(written, run, world, strategy):
    """2 -> 2 across strategies, 2 -> 3, and one process's checkpoint (1 -> 2, LoRA too)."""
    assert_same_state(_read(written / f"{run}@{world}-{strategy}.pt"), _read(written / f"{run}.pt"))


@pytest.mark.parametrize("run", ["fsdp", "ddp"])
def test_two_ranks_checkpoint_loads_into_one_process_without_a_process_group(written, run,
                                                                             tmp_path):
    load(None, "plain", False, str(written / run / STEP), str(tmp_path / "one.pt"))
    assert_same_state(_read(tmp_path / "one.pt"), _read(written / f"{run}.pt"))
    assert not torch.distributed.is_initialized()


def test_a_lora_checkpoint_holds_the_adapter_alone_and_loads_at_one_process(written, tmp_path):
    path = written / "lora" / STEP
    assert holds_adapter(path) and (path / "adapter_config.json").is_file()
    assert saved_model_keys(path) and all("lora_" in k for k in saved_model_keys(path))
    load(None, "plain", True, str(path), str(tmp_path / "one.pt"))
    assert_same_state(_read(tmp_path / "one.pt"), _read(written / "lora.pt"))
    with pytest.raises(ValueError, match="holds a LoRA adapter: load it with model.lora"):
        load_weights(path, tiny_model(0)[0])


def test_export_command_and_serve_read_a_sharded_checkpoint(written, tmp_path):
    """``turnrl export CHECKPOINT OUT`` (the command, as a user runs it) writes the writers'
    weights as a plain Hugging Face model; ``turnrl serve --serve.checkpoint`` (its
    ``load_server``, in this process) serves those same weights, tagged with the step."""
    from transformers import AutoModelForCausalLM

    from turnrl.serve import load_server

    path = written / "fsdp" / STEP
    expected = _read(written / "fsdp.pt")["model"]
    whole = full_weights(path)
    assert whole.keys() == expected.keys()
    assert all(torch.equal(whole[k], v) for k, v in expected.items())
    done = subprocess.run([sys.executable, "-m", "turnrl", "export", str(path),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    diff = float(done.stdout.rsplit("max |log-prob difference| on reload: ", 1)[1])
    assert diff <= 1e-5, done.stdout
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    state = exported.state_dict()
    assert state.keys() <= expected.keys() and "model.embed_tokens.weight" in state
    for name, tensor in state.items():
        assert torch.equal(tensor, expected[name]), name
    untrained = tiny_model(0)[0].state_dict()
    assert not all(torch.equal(untrained[k], v) for k, v in state.items())  # trained weights
    served = load_server(load_config(None, ["--model.name", "tiny", "--serve.checkpoint",
                                            str(path)]))
    assert served.engine.version == 2
    held = served.model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(held[name], tensor), name


def _damaged(written: Path, tmp_path: Path, damage) -> Path:
    path = tmp_path / "run" / STEP
    shutil.copytree(written / "fsdp" / STEP, path)
    damage(path)
    return path


@pytest.mark.parametrize("damage", [
    lambda p: (p / "__1_0.distcp").write_bytes((p / "__1_0.distcp").read_bytes()[:100]),
    lambda p: (p / "__0_0.distcp").unlink(),
    lambda p: (p / ".metadata").write_bytes(b"\x80\x04 not the index"),
], ids=["truncated shard", "missing shard", "overwritten metadata"])
def test_a_damaged_shard_is_one_line_and_touches_nothing(written, tmp_path, damage):
    path = _damaged(written, tmp_path, damage)
    model, _ = tiny_model(7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters())
    for attempt in (lambda: load_checkpoint(path, model, optimizer),
                    lambda: load_weights(path, model)):
        with pytest.raises(CheckpointError) as err:
            attempt()
        assert "\n" not in str(err.value) and str(path) in str(err.value)
        assert "not the file that was saved" in str(err.value) or "missing" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not optimizer.state


def test_one_process_can_write_a_sharded_checkpoint_and_refuses_non_finite_state(tmp_path):
    """No process group: save_sharded is the whole DCP write, through save_checkpoint."""
    model, _ = tiny_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()
    path = save_checkpoint(tmp_path, 1, model, optimizer, rng=rng_state(),
                           weights=lambda tmp: save_sharded(tmp, model, optimizer))
    assert is_sharded_checkpoint(path) and (path / "__0_0.distcp").is_file()
    fresh, _ = tiny_model(7)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state, rng = load_checkpoint(path, fresh, fresh_optimizer)
    assert state["step"] == 1 and "torch" in rng
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(),
                                                 strict=True))
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite"):
        save_checkpoint(tmp_path, 2, model, optimizer, rng=rng_state(),
                        weights=lambda tmp: save_sharded(tmp, model, optimizer))
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    with pytest.raises(FloatingPointError, match="embed_tokens.weight has non-finite"):
        save_sharded(tmp_path / "direct", model, optimizer)  # its own check, on every rank


def test_export_of_a_sharded_lora_checkpoint_merges_the_adapter(written, tmp_path):
    from transformers import AutoModelForCausalLM

    from turnrl.export import export_model

    result = export_model(written / "lora" / STEP, tmp_path / "out")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    base = tiny_model(0)[0].state_dict()
    moved = [k for k, v in exported.state_dict().items() if not torch.equal(v, base[k])]
    assert moved and all("q_proj" in k or "v_proj" in k for k in moved)
    assert result.max_logprob_diff <= 1e-5
