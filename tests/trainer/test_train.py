"""End to end: learning, update equivalences, resume after SIGKILL, CLI errors."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from turnrl.algorithms.losses import entropy_from_logits, token_logprobs
from turnrl.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint
from turnrl.cli import main
from turnrl.config import load_config
from turnrl.metrics import read_metrics
from turnrl.trainer import UpdateSettings, policy_update, train
from turnrl.trainer.step import score_policy_tokens
from turnrl.types import Batch

TESTS = Path(__file__).parents[1]
TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.progress", "false", "--run.tensorboard", "false"]


@pytest.mark.slow
def test_tiny_model_learns_a_toy_task(tmp_path):
    cfg = load_config(None, TINY + ["--optim.lr", "2e-2", "--run.steps", "20",
                                    "--optim.micro_batch_size", "32",
                                    "--run.out_dir", str(tmp_path)])
    result = train(cfg)
    assert result.before.success_rate < 0.3
    assert result.after.success_rate > 0.9
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 21))
    assert all(r["time/collect_s"] > 0 and r["time/update_s"] > 0 for r in records)
    summary = (tmp_path / "summary.txt").read_text()
    assert "before" in summary and "after 20 steps" in summary
    assert len(list((tmp_path / "episodes").glob("*.jsonl"))) == 20


def _batch(tiny, rows=6):
    model, tok = tiny
    torch.manual_seed(0)
    ids = torch.randint(3, len(tok), (rows, 12))
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, 6:] = 1
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0  # a shorter row
    mask[1, 9:] = 0
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    old = torch.zeros_like(mask)
    old[:, 1:] = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]
    return Batch(ids, attention, mask, old, torch.linspace(-1, 1, rows))


def test_scoring_policy_tokens_only_equals_the_full_logits(tiny):
    model, _ = tiny
    batch = _batch(tiny)
    logprobs, entropy = score_policy_tokens(model, batch, 0.7, entropy=True)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    full = token_logprobs(logits[:, :-1], batch.input_ids[:, 1:], 0.7)
    mask = batch.loss_mask[:, 1:].bool()
    assert torch.allclose(logprobs[mask], full[mask], atol=1e-5)
    assert torch.all(logprobs[~mask] == 0)
    assert torch.allclose(entropy[mask], entropy_from_logits(logits[:, :-1], 0.7)[mask],
                          atol=1e-5)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_gradient_accumulation_matches_one_big_batch(tiny, agg):
    model, _ = tiny
    batch = _batch(tiny)
    cfg = load_config(None, ["--algo.loss_agg", agg, "--optim.max_grad_norm", "0"])
    grads = []
    for micro in (6, 2):
        settings = UpdateSettings(cfg.algo, cfg.optim.__class__(micro_batch_size=micro,
                                                                max_grad_norm=0), 1.0, 12)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        policy_update(model, optimizer, batch, settings)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_on_policy_update_has_ratio_one_then_kl_grows(tiny):
    import copy

    model, _ = tiny
    ref = copy.deepcopy(model)
    batch = _batch(tiny)
    cfg = load_config(None, ["--algo.kl_coef", "0.1", "--algo.epochs", "1"])
    settings = UpdateSettings(cfg.algo, cfg.optim, 1.0, 12)
    # Behaviour logprobs came from this very model: ratio 1, nothing clipped, KL to ref 0.
    still = policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, settings, ref)
    assert still["clip_fraction"] == 0.0 and abs(still["kl"]) < 1e-6 and still["entropy"] > 0
    settings = UpdateSettings(cfg.algo.__class__(kl_coef=0.1, epochs=4), cfg.optim, 1.0, 12)
    moved = policy_update(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batch,
                          settings, ref)
    assert moved["kl"] > 1e-4  # later epochs score a policy that has left the reference
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(),
                                                      strict=True))


def _steps(checkpoints: Path) -> list[int]:
    """The steps of the checkpoints in ``checkpoints`` now."""
    return [int(p.name.split("-")[1]) for p in checkpoints.glob("step-*")]


def _train_args(out_dir, *extra):
    return ["train", *TINY, "--run.out_dir", str(out_dir), "--eval.episodes", "0",
            "--run.checkpoint_every", "2", "--optim.lr", "1e-3", *extra]


def _train_cmd(out_dir, *extra):
    return [sys.executable, "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import conftest; "
            "from turnrl.cli import main; sys.exit(main(sys.argv[2:]))",
            str(TESTS), *_train_args(out_dir, *extra)]


@pytest.mark.parametrize("matmul", ["torch", "onednn"])
def test_resume_after_sigkill_continues_from_the_checkpoint(tmp_path, matmul, capsys):
    """Also with the sampler on oneDNN's packed products (``sampler.matmul onednn``): the
    resumed run repacks the loaded weights and samples what the uninterrupted one did."""
    def train_args(out_dir, *extra):
        return _train_args(out_dir, "--sampler.matmul", matmul, *extra)

    def train_cmd(out_dir, *extra):
        return _train_cmd(out_dir, "--sampler.matmul", matmul, *extra)

    proc = subprocess.Popen(train_cmd(tmp_path, "--run.steps", "200"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoints = tmp_path / "checkpoints"
    # Loose: a process's start (torch, the model) on a busy machine can take a minute; a
    # checkpoint at step 4 or later, whichever the two kept (step-00000[4-9] could be missed)
    deadline = time.monotonic() + 600
    while (time.monotonic() < deadline and proc.poll() is None
           and max(_steps(checkpoints), default=0) < 4):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    saved = sorted(p.name for p in checkpoints.glob("step-*"))
    assert saved, "no checkpoint before the kill"
    resume_from = int(saved[-1].split("-")[1])
    config_before = (tmp_path / "config.yaml").read_text()

    # Without --resume a run directory with checkpoints is refused, not overwritten. The
    # command's own entry point, in this process: a refusal needs no interpreter of its own.
    capsys.readouterr()
    assert main(train_args(tmp_path, "--run.steps", "12")) == 2
    assert "--resume" in capsys.readouterr().err

    # Resuming may extend the run, but not silently change what it trains.
    assert main(train_args(tmp_path, "--run.steps", "12", "--resume", "--optim.lr", "5")) == 2
    assert "cannot change optim.lr" in capsys.readouterr().err

    final = resume_from + 4
    done = subprocess.run(train_cmd(tmp_path, "--run.steps", str(final), "--resume"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert f"from step {resume_from}" in done.stdout
    assert (tmp_path / "config.yaml").read_text() == config_before.replace(
        "steps: 200", f"steps: {final}")
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == list(range(1, final + 1))  # no step lost or logged twice

    # Model, optimiser and RNG states all came back: the same weights as a run never killed.
    straight = tmp_path.parent / f"{tmp_path.name}-straight"
    subprocess.run(train_cmd(straight, "--run.steps", str(final)), check=True,
                   capture_output=True, timeout=600)
    resumed = load_file(checkpoints / f"step-{final:06d}" / "model.safetensors")
    uninterrupted = load_file(straight / "checkpoints" / f"step-{final:06d}" / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


def test_resume_before_the_first_checkpoint_samples_what_the_uninterrupted_run_sampled(
        tmp_path, monkeypatch):
    """A crash after the 'before' evaluation and before any checkpoint (here: the first
    collection raises, leaving on disk what a kill at that moment leaves): the resumed run
    must not draw step 1 from another random stream than the uninterrupted run did."""
    import turnrl.trainer.local as local

    run = TINY + ["--eval.episodes", "4", "--optim.lr", "1e-3", "--run.checkpoint_every", "0",
                  "--run.steps", "3"]
    straight = train(load_config(None, run + ["--run.out_dir", str(tmp_path / "straight")]))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt
    cut = load_config(None, run + ["--run.out_dir", str(tmp_path / "cut")])
    with monkeypatch.context() as patch:
        patch.setattr(local, "play_seeds", killed)
        with pytest.raises(KeyboardInterrupt):
            train(cut)
    assert (tmp_path / "cut" / "eval_before.json").exists()
    assert not (tmp_path / "cut" / "checkpoints").exists()
    resumed = train(cut, resume=True)
    assert resumed.before == straight.before  # read back, not re-measured
    a = load_file(tmp_path / "straight" / "checkpoints" / "step-000003" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "checkpoints" / "step-000003" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_torn_by_a_crash_is_never_loaded(tmp_path, tiny):
    model, _ = tiny
    optimizer = torch.optim.AdamW(model.parameters())
    whole = save_checkpoint(tmp_path, 4, model, optimizer, rng=rng_state())
    torn = tmp_path / "checkpoints" / ".tmp-step-000008-999"  # killed mid-save
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"half")
    assert latest_checkpoint(tmp_path) == whole
    assert not torn.exists()
    state, _ = load_checkpoint(whole, model, optimizer)
    assert state["step"] == 4


def test_a_new_run_in_a_used_directory_starts_clean(tmp_path):
    run = ["--run.out_dir", str(tmp_path), "--run.checkpoint_every", "0", "--run.steps", "2",
           "--eval.episodes", "2"]
    first = load_config(None, TINY + run)
    # A first attempt that never reached a checkpoint: only its per-run files are there.
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 9}\n')
    (tmp_path / "eval_before.json").write_text('{"episodes": 99}')
    result = train(first)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert result.before.episodes == 2


@pytest.mark.parametrize("args, message", [
    (["--algo.clip_hihg", "0.3"], "did you mean 'algo.clip_high'"),
    (["--algo.clip_high", "abc"], "algo.clip_high: expected float, got 'abc'"),
    (["--model.name", "/no/such/model"], "model '/no/such/model' not found"),
    (["--env.name", "guess-nmber", "--model.name", "tiny"], "did you mean 'guess-number'"),
])
def test_cli_bad_input_gives_one_line_error(tmp_path, args, message):
    out = subprocess.run([sys.executable, "-m", "turnrl.cli", "train", "--run.out_dir",
                          str(tmp_path), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_report_and_envs_commands(tmp_path):
    from turnrl.cli import main
    from turnrl.metrics import MetricsLogger

    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 4):
            logger.log(step, {"reward/mean": step / 4, "success/rate": step / 5})
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert main(["envs"]) == 0
    assert main(["no-such-command"]) == 2


def test_eval_command_scores_a_checkpoint(tmp_path, capsys):
    from turnrl.cli import main

    common = ["--model.name", "tiny", "--env.name", "guess-number", "--eval.episodes", "6",
              "--run.progress", "false"]
    assert main(["train", *common, "--run.steps", "1", "--run.out_dir", str(tmp_path)]) == 0
    capsys.readouterr()
    checkpoint = tmp_path / "checkpoints" / "step-000001"
    assert main(["eval", *common, "--checkpoint", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "step-000001" in out and "episodes" in out
    assert main(["eval", *common, "--checkpoint", str(tmp_path / "nope")]) == 2


def test_a_sampler_state_from_another_device_is_not_forced_into_the_generator():
    """A CPU run's checkpoint resumed on a GPU: the CPU sampler state cannot go into a CUDA
    generator (setting it raises); the resume warns and goes on."""
    import types

    from turnrl.checkpoint import engine_state_fits, restore_rng

    cpu = torch.Generator().manual_seed(1)
    state = rng_state(cpu)
    assert state["engine_device"] == "cpu" and engine_state_fits(state, cpu)
    cuda_like = types.SimpleNamespace(device=torch.device("cuda"), set_state=None)
    assert not engine_state_fits(state, cuda_like)
    assert not engine_state_fits({"engine": b""} | {"engine_device": "cuda"}, cpu)
    with pytest.warns(UserWarning, match="sampler state is for a cpu generator"):
        restore_rng(state, cuda_like)  # set_state=None: calling it would raise
    old = {k: v for k, v in state.items() if k != "engine_device"}  # older checkpoints
    assert engine_state_fits(old, cpu)
