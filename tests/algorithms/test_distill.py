"""On-policy distillation: the reverse-KL advantage by hand, the teacher's loading errors, and a
tiny student that learns a teacher's behaviour from the teacher's scores alone."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from turnrl.algorithms.distill import (
    mean_reverse_kl,
    per_token,
    reverse_kl_advantages,
    with_distillation,
)
from turnrl.algorithms.losses import clipped_policy_loss
from turnrl.checkpoint import rng_state, save_checkpoint
from turnrl.config import ConfigError, load_config, save_config
from turnrl.metrics import read_metrics
from turnrl.models import IM_END, load_model, tiny_model
from turnrl.trainer import train
from turnrl.trainer.distill import load_teacher, teacher_logprobs
from turnrl.trainer.step import UpdateSettings, score_policy_tokens
from turnrl.types import Batch

TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.progress", "false", "--run.tensorboard", "false"]

# Two episodes of 4 tokens; token 0 is the prompt, the policy sampled the rest of row 0 and
# tokens 1-2 of row 1 (token 3 of row 1 is padding).
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
STUDENT = torch.tensor([[0.0, -1.0, -0.5, -2.0], [0.0, -0.2, -3.0, 0.0]])
TEACHER = torch.tensor([[0.0, -0.5, -1.5, -2.0], [0.0, -2.2, -1.0, 0.0]])


def test_reverse_kl_advantages_by_hand():
    got = reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=0.5)
    # s - t on the policy tokens: row 0: -0.5, 1.0, 0.0; row 1: 2.0, -2.0; times -0.5
    expected = torch.tensor([[0.0, 0.25, -0.5, 0.0], [0.0, -1.0, 1.0, 0.0]])
    assert torch.allclose(got, expected)
    # Tokens the teacher likes more than the student gain, the others lose; off-mask is 0.
    student = STUDENT.clone().requires_grad_()
    assert not reverse_kl_advantages(student, TEACHER, MASK, 1.0).requires_grad


def test_the_mean_baseline_subtracts_the_batch_mean_gap_on_policy_tokens_only():
    got = reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=0.5, baseline="mean")
    # gaps -0.5, 1.0, 0.0 | 2.0, -2.0 have mean 0.1: (gap - 0.1) * -0.5 on policy tokens
    expected = torch.tensor([[0.0, 0.3, -0.45, 0.05], [0.0, -0.95, 1.05, 0.0]])
    assert torch.allclose(got, expected)
    assert abs(float(got.sum())) < 1e-6  # centred over the policy tokens
    # A gap shared by every token (the teacher uniformly less sure) teaches nothing.
    assert torch.allclose(reverse_kl_advantages(TEACHER + 0.7, TEACHER, MASK, 1.0, "mean"),
                          torch.zeros_like(MASK), atol=1e-6)
    with pytest.raises(ValueError, match="none or mean"):
        reverse_kl_advantages(STUDENT, TEACHER, MASK, 1.0, "median")


def test_mean_reverse_kl_by_hand():
    # gaps on the 5 policy tokens: -0.5, 1.0, 0.0, 2.0, -2.0 -> mean 0.1
    assert math.isclose(mean_reverse_kl(STUDENT, TEACHER, MASK), 0.1, rel_tol=1e-6)
    assert mean_reverse_kl(STUDENT, TEACHER, torch.zeros_like(MASK)) == 0.0


@pytest.mark.parametrize("task", [torch.tensor([1.0, -2.0]),
                                  torch.tensor([[9.0, 1.0, 2.0, 3.0], [9.0, -1.0, -2.0, 9.0]])],
                         ids=["episode-level", "token-level"])
def test_the_kl_term_adds_to_the_task_advantage_or_replaces_it(task):
    kl = reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=0.5)
    mixed = with_distillation(task, kl, MASK, only=False)
    if task.dim() == 1:
        expected_task = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, -2.0, -2.0, 0.0]])
    else:
        expected_task = task
    assert torch.allclose(mixed, expected_task + kl)
    assert torch.equal(with_distillation(task, kl, MASK, only=True), kl)
    assert per_token(task, MASK).shape == MASK.shape


def test_at_ratio_one_the_surrogate_gradient_is_the_reverse_kl_policy_gradient():
    """Through the clipped surrogate, an on-policy token's gradient is -(s - t) grad log p_s:
    the REINFORCE estimate of the per-token reverse KL (what GKD/MiniLLM minimise)."""
    logp = STUDENT[:, 1:].clone().requires_grad_()
    adv = reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=1.0)[:, 1:]
    per_tok, _ = clipped_policy_loss(logp, STUDENT[:, 1:], adv, 0.2, 0.2, 0.0)
    (per_tok * MASK[:, 1:]).sum().backward()
    expected = (STUDENT - TEACHER)[:, 1:] * MASK[:, 1:]  # d/dlogp of -A * exp(logp - old)
    assert torch.allclose(logp.grad, expected)


# --- the teacher: loading, errors, scoring ---------------------------------------------------


def _cfg(*extra):
    return load_config(None, TINY + list(extra))


def _saved_tiny(path, *, seed=0, edit=None):
    """A tiny model saved as a Hugging Face directory; ``edit`` changes its tokenizer.json."""
    model, tokenizer = tiny_model(seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if edit is not None:
        spec = json.loads((path / "tokenizer.json").read_text())
        edit(spec)
        (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


def _swap_two_digits(spec):
    vocab = spec["model"]["vocab"]
    vocab["7"], vocab["8"] = vocab["8"], vocab["7"]


def _add_a_token(spec):
    spec["added_tokens"].append({"id": max(spec["model"]["vocab"].values()) + 1,
                                 "content": "<tool>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})


def test_a_teacher_with_the_same_tokenizer_loads_frozen_in_eval_mode(tmp_path):
    _, tokenizer = tiny_model()
    teacher = load_teacher(_cfg("--distill.teacher", str(_saved_tiny(tmp_path, seed=3))),
                           tokenizer, torch.device("cpu"))
    assert not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    assert load_teacher(_cfg(), tokenizer, torch.device("cpu")) is None  # off by default


@pytest.mark.parametrize("edit", [_swap_two_digits, _add_a_token], ids=["remapped", "extra"])
def test_a_teacher_with_another_tokenizer_is_refused_naming_both_models(tmp_path, edit):
    _, tokenizer = tiny_model()
    path = _saved_tiny(tmp_path / "teacher", edit=edit)
    with pytest.raises(ConfigError) as err:
        load_teacher(_cfg("--distill.teacher", str(path)), tokenizer, torch.device("cpu"))
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "'tiny'" in message
    assert "different tokenizers" in message


@pytest.mark.parametrize("where", ["missing", "empty-dir", "a-file", "checkpoint-without-run"])
def test_a_bad_teacher_path_is_one_line_naming_the_key(tmp_path, where):
    path = tmp_path / where
    if where == "empty-dir":
        path.mkdir()
    elif where == "a-file":
        path.write_text("not a model")
    elif where == "checkpoint-without-run":  # weights but no RUN_DIR/config.yaml above
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"")
        (path / "state.json").write_text("{}")
    _, tokenizer = tiny_model()
    with pytest.raises(ConfigError, match=r"^distill\.teacher: model (path )?.* not found") as err:
        load_teacher(_cfg("--distill.teacher", str(path)), tokenizer, torch.device("cpu"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args, message", [
    (["--distill.only", "true"], "distill.only needs distill.teacher"),
    (["--distill.teacher", "tiny", "--distill.only", "true", "--distill.coef", "0"],
     "no learning signal"),
    (["--distill.teacher", "tiny", "--distill.coef", "-1"], "distill.coef must be >= 0"),
    (["--distill.teacher", "tiny", "--run.mode", "async"], "run.mode sync only"),
    (["--distill.teacher", "tiny", "--distill.baseline", "median"],
     "distill.baseline: 'median' is not one of mean, none"),
])
def test_config_refuses_what_distillation_cannot_honour(args, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*args)


def test_the_cli_reports_a_bad_teacher_in_one_line(tmp_path):
    args = [*TINY[:2], "--env.name", "arithmetic", *TINY[4:]]  # a subprocess: a built-in env
    done = subprocess.run([sys.executable, "-m", "turnrl.cli", "train", *args,
                           "--distill.teacher", str(tmp_path / "nope"), "--run.steps", "1",
                           "--run.out_dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "distill.teacher" in lines[0] and "nope" in lines[0], done.stderr


def test_teacher_logprobs_align_with_old_logprobs(tiny):
    """Scored in micro-batches (with a shared prompt), the teacher's log-probs sit where
    ``old_logprobs`` would: the same model as teacher reproduces the student's exactly."""
    model, tok = tiny
    torch.manual_seed(0)
    ids = torch.randint(3, len(tok), (5, 10))
    ids[:, :4] = ids[0, :4]  # one prompt shared by every row
    mask = torch.zeros(5, 10)
    mask[:, 5:] = 1
    attention = torch.ones_like(ids)
    attention[2, 8:] = 0
    mask[2, 8:] = 0
    batch = Batch(ids, attention, mask, torch.zeros(5, 10), torch.zeros(5))
    settings = UpdateSettings(_cfg().algo, _cfg("--optim.micro_batch_size", "2",
                                                "--optim.shared_prefix", "true").optim,
                              temperature=0.7, agg_constant=1)
    with torch.no_grad():
        whole, _ = score_policy_tokens(model.eval(), batch, 0.7)
    got = teacher_logprobs(model, batch, settings)
    assert torch.allclose(got[:, 1:], whole, atol=1e-5)
    assert torch.all(got[mask == 0] == 0) and torch.all(got[mask == 1] < 0)


# --- learning: a fresh student moves to a teacher that says digits ---------------------------


def _digit_teacher(run_dir):
    """The tiny model fitted to answer 'Say a digit.' with a digit, saved as a TurnRL checkpoint
    (the run's config.yaml names the base model): a teacher unlike the fresh student."""
    model, tok = tiny_model()
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say a digit."}],
                                                add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    end = tok.convert_tokens_to_ids(IM_END)
    rows = torch.tensor([prompt + tok.encode(str(d), add_special_tokens=False) + [end]
                         for d in range(10)])
    # A light fit (about 80% of its first-token mass on digits), like a short trained run of
    # the same model: far from the student on this task, near it elsewhere.
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(20):
        logits = model(input_ids=rows).logits[:, len(prompt) - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 rows[:, len(prompt):].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    run_dir.mkdir()
    save_config(_cfg(), run_dir / "config.yaml")
    return save_checkpoint(run_dir, 1, model, optimizer, rng=rng_state())


@pytest.mark.slow
def test_a_fresh_student_learns_the_teachers_behaviour_from_the_reverse_kl_alone(tmp_path):
    teacher_dir = _digit_teacher(tmp_path / "teacher-run")
    teacher, _ = load_model(str(teacher_dir))  # the checkpoint loads as tiny + its weights
    assert not torch.equal(teacher.model.embed_tokens.weight,
                           tiny_model()[0].model.embed_tokens.weight)
    cfg = _cfg("--distill.teacher", str(teacher_dir), "--distill.only", "true",
               "--optim.lr", "2e-2", "--run.steps", "15", "--optim.micro_batch_size", "32",
               "--run.out_dir", str(tmp_path / "student"))
    result = train(cfg)
    records = read_metrics(tmp_path / "student" / "metrics.jsonl")
    kl = [r["distill/reverse_kl"] for r in records]
    assert all(r["distill/teacher_s"] > 0 for r in records)
    # The student closes most of its gap to the teacher (first vs last three steps)...
    assert sum(kl[-3:]) < 0.5 * sum(kl[:3]), kl
    # ...and behaves like it: it says digits, though the task reward was never used.
    assert result.before.success_rate < 0.15
    assert result.after.success_rate > result.before.success_rate + 0.3, (result.before,
                                                                         result.after)


@pytest.mark.parametrize("given", ["run", "run/", "run/checkpoints", "run/checkpoints/step-000009"])
def test_a_teacher_named_by_its_run_or_a_missing_step_names_the_checkpoint_to_use(tmp_path,
                                                                                given):
    """A run directory (or its checkpoints/, or a step it does not have) as the teacher: the
    line names the run's newest checkpoint (before: 'pass a local Hugging Face model
    directory, a hub id ORG/NAME, ...', or for checkpoints/ that it hid a hub id)."""
    from tests.test_export import make_run

    make_run(tmp_path / "run", step=2, scale=0.0)
    newest = make_run(tmp_path / "run", step=4, scale=0.0)
    _, tokenizer = tiny_model()
    with pytest.raises(ConfigError) as err:
        load_teacher(_cfg("--distill.teacher", str(tmp_path / given)), tokenizer,
                     torch.device("cpu"))
    message = str(err.value)
    assert "\n" not in message and message.startswith("distill.teacher: model")
    assert f"name a checkpoint of the TurnRL run '{tmp_path / 'run'}', e.g. its newest " \
           f"{newest}" in message
    teacher = load_teacher(_cfg("--distill.teacher", str(newest)), tokenizer,
                           torch.device("cpu"))
    assert not teacher.training
