"""Hub ids (``--model.name ORG/NAME``) load through the Hugging Face cache, offline here: a real
tiny model is laid out in a temporary cache exactly as the hub lays it out (blobs, refs,
snapshots of symlinks), with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turnrl.config import load_config
from turnrl.metrics import read_metrics
from turnrl.models import ModelNotFoundError, load_model, model_directory, tiny_model
from turnrl.trainer import train

REPO = "turnrl-test/tiny-llama"
MAIN, OTHER = "a" * 40, "b" * 40  # commit hashes of two revisions
ROOT = Path(__file__).resolve().parent.parent

CUSTOM_CODE = '''
from transformers import LlamaConfig, LlamaForCausalLM


class ShiftedConfig(LlamaConfig):
    model_type = "turnrl_shifted"


class ShiftedForCausalLM(LlamaForCausalLM):
    """A model only its own code can build: every logit is shifted by 7."""
    config_class = ShiftedConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits + 7.0
        return out
'''


def put_snapshot(cache: Path, repo: str, commit: str, files: dict[str, bytes],
                 refs: tuple[str, ...] = ()) -> Path:
    """Write ``files`` as the hub does: contents in blobs/<sha256>, snapshots/<commit>/NAME a
    relative symlink to its blob, refs/<ref> holding the commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    for ref in refs:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


def tiny_files(tmp: Path, seed: int) -> dict[str, bytes]:
    """The files of the tiny model built with ``seed``, as save_pretrained writes them."""
    model, tokenizer = tiny_model(seed)
    out = tmp / f"saved-{seed}"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def logits(model, text: str = "<|im_start|>user\nhi<|im_end|>\n") -> torch.Tensor:
    ids = torch.tensor([list(range(3, 3 + len(text)))])
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline hub cache holding REPO at main (seed 0) and at OTHER, tag v2 (seed 1)."""
    cache = tmp_path / "hub"
    put_snapshot(cache, REPO, MAIN, tiny_files(tmp_path, 0), refs=("main",))
    put_snapshot(cache, REPO, OTHER, tiny_files(tmp_path, 1), refs=("v2",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_id_loads_the_cached_snapshot_of_main(hub_cache):
    model, tokenizer = load_model(REPO)
    expected, _ = tiny_model(0)
    assert torch.equal(logits(model), logits(expected))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    assert model_directory(REPO) == hub_cache / f"models--turnrl-test--tiny-llama/snapshots/{MAIN}"


@pytest.mark.parametrize("revision", ["v2", OTHER])
def test_the_revision_is_honoured_as_a_tag_or_a_commit(hub_cache, revision):
    model, _ = load_model(REPO, revision=revision)
    other, _ = tiny_model(1)
    main, _ = tiny_model(0)
    assert torch.equal(logits(model), logits(other))
    assert not torch.equal(logits(model), logits(main))


def test_hf_home_locates_the_cache_too(hub_cache, monkeypatch, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (hub_cache).rename(home / "hub")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(home))
    model, _ = load_model(REPO)
    assert torch.equal(logits(model), logits(tiny_model(0)[0]))


@pytest.mark.parametrize("name, revision, named", [
    ("turnrl-test/not-there", "", "'turnrl-test/not-there'"),
    (REPO, "v3", "at revision 'v3'"),
    (REPO, "c" * 40, f"at revision '{'c' * 40}'"),
])
def test_a_model_missing_from_the_offline_cache_is_one_line_with_the_fix(
        hub_cache, name, revision, named):
    with pytest.raises(ModelNotFoundError) as caught:
        load_model(name, revision=revision)
    message = str(caught.value)
    assert "\n" not in message and named in message
    assert str(hub_cache) in message and "HF_HUB_OFFLINE=1" in message
    assert f"hf download {name}" in message and f"huggingface-cli download {name}" in message
    if revision:
        assert f"--revision {revision}" in message


def test_remote_code_runs_only_when_asked(tmp_path, monkeypatch):
    files = tiny_files(tmp_path, 0)
    config = __import__("json").loads(files["config.json"])
    config.update(model_type="turnrl_shifted", architectures=["ShiftedForCausalLM"],
                  auto_map={"AutoConfig": "shifted.ShiftedConfig",
                            "AutoModelForCausalLM": "shifted.ShiftedForCausalLM"})
    files["config.json"] = __import__("json").dumps(config).encode()
    files["shifted.py"] = CUSTOM_CODE.encode()
    cache = tmp_path / "hub"
    put_snapshot(cache, "turnrl-test/shifted", MAIN, files, refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model("turnrl-test/shifted")
    model, _ = load_model("turnrl-test/shifted", trust_remote_code=True)
    assert type(model).__name__ == "ShiftedForCausalLM"
    assert torch.allclose(logits(model), logits(tiny_model(0)[0]) + 7.0, atol=1e-5)


def test_local_directories_and_tiny_still_load(tmp_path):
    model, _ = tiny_model(2)
    model.save_pretrained(tmp_path / "local")
    tiny_model(2)[1].save_pretrained(tmp_path / "local")
    loaded, _ = load_model(str(tmp_path / "local"))
    assert torch.equal(logits(loaded), logits(model))
    assert load_model("tiny")[0].config.hidden_size == 64
    with pytest.raises(ModelNotFoundError, match="hub id ORG/NAME"):
        load_model(str(tmp_path / "no" / "such" / "dir"))


def test_a_run_trains_from_a_hub_id(hub_cache, tmp_path):
    cfg = load_config(None, ["--model.name", REPO, "--model.revision", "v2",
                             "--rollout.group_size", "2", "--rollout.groups_per_step", "1",
                             "--run.steps", "1", "--eval.episodes", "0", "--env.name",
                             "say-digit", "--run.progress", "false", "--run.tensorboard",
                             "false", "--run.out_dir", str(tmp_path / "run")])
    train(cfg)
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_the_cli_says_how_to_pre_download_in_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "turnrl.cli", "train", "--model.name",
                          "some-org/some-model", "--run.out_dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "turnrl train: error: hub model 'some-org/some-model'" in lines[0]
    assert "hf download some-org/some-model" in lines[0] and str(tmp_path / "empty") in lines[0]


@pytest.mark.parametrize("name, says", [
    (f"{REPO}@v2", f"a revision is not part of the name: --model.name {REPO} --model.revision v2"),
    (f"{REPO}/", f"did you mean the hub id '{REPO}'?"),
    (f" {REPO}", f"did you mean the hub id '{REPO}'?"),
    (f"{REPO}\n", f"did you mean the hub id '{REPO}'?"),
    (f"https://huggingface.co/{REPO}", f"did you mean the hub id '{REPO}'?"),
    ("shadow/model", "'shadow/model' is a local directory without config.json (not a model "
                     "directory), and as a path it hides the hub id shadow/model"),
    ("shadow/model/", "'shadow/model' is a local directory without config.json"),
])
def test_a_name_that_nearly_reads_as_a_hub_id_says_what_is_wrong(hub_cache, tmp_path,
                                                                 monkeypatch, name, says):
    """Before: the same generic 'pass a local directory, a hub id ORG/NAME, ...' line for
    each, which names none of the actual mistakes."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shadow" / "model").mkdir(parents=True)  # e.g. a run's output, no config.json
    with pytest.raises(ModelNotFoundError) as caught:
        load_model(name)
    message = str(caught.value)
    assert says in message and message.count("\n") == name.count("\n")
    load_model(REPO)  # the id itself loads
