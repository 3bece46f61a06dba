"""``turnrl export``: a checkpoint becomes a directory plain transformers loads, with the run's
tokenizer and chat template, and the same log-probabilities as the checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turnrl.checkpoint import rng_state, save_checkpoint
from turnrl.config import load_config
from turnrl.config.load import save_config
from turnrl.export import PROBE, export_model, probe_logprobs
from turnrl.models import CHATML_TEMPLATE, load_model, tiny_model
from turnrl.trainer import train

ROOT = Path(__file__).resolve().parent.parent
# ChatML with the roles in capitals: a template only this run used, so an export that kept
# the tokenizer's own one is caught.
RUN_TEMPLATE = CHATML_TEMPLATE.replace("message['role']", "(message['role'] | upper)")


def make_run(run_dir: Path, *, template: Path | None = None, step: int = 3,
             scale: float = 0.05) -> Path:
    """A run directory on the tiny model with one checkpoint whose weights moved away from the
    base model (every weight shifted by noise of ``scale``), as the trainer writes it."""
    overrides = ["--model.name", "tiny", "--run.out_dir", str(run_dir)]
    if template is not None:
        overrides += ["--model.chat_template", str(template)]
    save_config(load_config(None, overrides), run_dir / "config.yaml")
    model, _ = tiny_model(0)
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale)
    optimizer = torch.optim.AdamW(model.parameters())
    return save_checkpoint(run_dir, step, model, optimizer, rng=rng_state())


def plain_load(out: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(out, local_files_only=True),
            AutoTokenizer.from_pretrained(out, local_files_only=True))


def test_an_export_reloads_with_plain_transformers_and_the_checkpoints_logprobs(tmp_path):
    template = tmp_path / "upper.jinja"
    template.write_text(RUN_TEMPLATE)
    checkpoint = make_run(tmp_path / "run", template=template)
    result = export_model(checkpoint, tmp_path / "out")
    model, tokenizer = plain_load(tmp_path / "out")
    assert tokenizer.chat_template == RUN_TEMPLATE
    assert "<|im_start|>USER\n" in tokenizer.apply_chat_template(PROBE, tokenize=False)
    ours, _ = load_model(str(checkpoint))
    ours_tokenizer = tiny_model(0)[1]
    ours_tokenizer.chat_template = RUN_TEMPLATE
    expected = probe_logprobs(ours.eval(), ours_tokenizer)
    got = probe_logprobs(model.eval(), tokenizer)
    diff = float((expected - got).abs().max())
    print(f"max |log-prob difference| checkpoint vs export: {diff:.3g}")
    assert diff <= 1e-5 and result.max_logprob_diff <= 1e-5
    # the checkpoint's weights, not the base model's: those give other log-probs
    base = probe_logprobs(tiny_model(0)[0].eval(), ours_tokenizer)
    assert float((base - got).abs().max()) > 1e-3
    record = json.loads((tmp_path / "out" / "turnrl_export.json").read_text())
    assert record["step"] == 3 and record["base_model"] == "tiny"


def test_a_bfloat16_run_exports_in_bfloat16(tmp_path):
    run = tmp_path / "run"
    save_config(load_config(None, ["--model.name", "tiny", "--model.dtype", "bfloat16"]),
                run / "config.yaml")
    model, _ = load_model("tiny", dtype="bfloat16")
    save_checkpoint(run, 1, model, torch.optim.AdamW(model.parameters()), rng=rng_state())
    result = export_model(run, tmp_path / "out")
    reloaded, _ = plain_load(tmp_path / "out")
    assert reloaded.dtype == torch.bfloat16 and result.max_logprob_diff < 5e-2


def test_a_run_dir_exports_its_last_checkpoint_through_the_cli(tmp_path):
    run = tmp_path / "run"
    make_run(run, step=2, scale=0.0)
    last = make_run(run, step=5)  # keep=2: both stay, the newer must win
    out = subprocess.run([sys.executable, "-m", "turnrl.cli", "export", str(run),
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"exported {last}" in out.stdout and "max |log-prob difference|" in out.stdout
    record = json.loads((tmp_path / "out" / "turnrl_export.json").read_text())
    assert record["step"] == 5
    model, tokenizer = plain_load(tmp_path / "out")
    assert tokenizer.chat_template == CHATML_TEMPLATE  # the run kept the model's own


def test_a_trained_run_exports(tmp_path):
    cfg = load_config(None, ["--model.name", "tiny", "--env.name", "say-digit",
                             "--rollout.group_size", "2", "--rollout.groups_per_step", "1",
                             "--run.steps", "1", "--eval.episodes", "0", "--run.progress",
                             "false", "--run.tensorboard", "false", "--run.out_dir",
                             str(tmp_path / "run")])
    train(cfg)
    result = export_model(tmp_path / "run", tmp_path / "out")
    assert result.checkpoint.name == "step-000001" and result.max_logprob_diff <= 1e-5
    assert plain_load(tmp_path / "out")[0].config.hidden_size == 64


@pytest.mark.parametrize("case, message", [
    ("nothing", "neither a TurnRL checkpoint"),
    ("empty run", "has no checkpoint yet"),
    ("out not empty", "exists and is not empty"),
    ("template gone", "model.chat_template must be an existing file"),
    ("adapter only", "this run has no LoRA adapter"),
])
def test_bad_exports_are_one_line_with_the_fix_and_write_nothing(tmp_path, case, message):
    run, out = tmp_path / "run", tmp_path / "out"
    args = ["export", str(run), str(out)]
    if case == "nothing":
        run.mkdir()
    elif case == "empty run":
        save_config(load_config(None, ["--model.name", "tiny"]), run / "config.yaml")
    else:
        template = tmp_path / "t.jinja"
        template.write_text(RUN_TEMPLATE)
        make_run(run, template=template)
        if case == "out not empty":
            out.mkdir()
            (out / "keep.txt").write_text("mine")
        elif case == "template gone":
            template.unlink()
        elif case == "adapter only":
            args.append("--adapter-only")
    done = subprocess.run([sys.executable, "-m", "turnrl.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr
    if case == "out not empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]


def test_a_run_with_a_relative_chat_template_exports_and_resumes_from_another_directory(
        tmp_path, monkeypatch):
    """``--model.chat_template my.jinja`` was stored as given: export, resume or eval run
    from any other directory refused the run ('must be an existing file')."""
    home, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    # trainable (the generation prompt is the assistant's own), and only this run's
    template = CHATML_TEMPLATE.replace("message['role']", "(message['role'] | replace('user', "
                                       "'USER'))")
    (home / "upper.jinja").write_text(template)
    monkeypatch.chdir(home)
    args = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.group_size", "2",
            "--rollout.groups_per_step", "1", "--eval.episodes", "0", "--run.progress",
            "false", "--run.tensorboard", "false", "--run.out_dir", str(tmp_path / "run"),
            "--model.chat_template", "upper.jinja"]
    train(load_config(None, [*args, "--run.steps", "1"]))
    monkeypatch.chdir(elsewhere)
    result = export_model(tmp_path / "run", "out")
    assert result.max_logprob_diff <= 1e-5
    assert plain_load(elsewhere / "out")[1].chat_template == template
    monkeypatch.chdir(home)
    assert load_config(None, args).model.chat_template == str(home / "upper.jinja")
    monkeypatch.chdir(elsewhere)
    stored = [a if a != "upper.jinja" else str(home / "upper.jinja") for a in args]
    train(load_config(None, [*stored, "--run.steps", "2"]), resume=True)
    assert (tmp_path / "run" / "checkpoints" / "step-000002").is_dir()
