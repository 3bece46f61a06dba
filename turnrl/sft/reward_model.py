"""``turnrl rm --data pairs.jsonl``: a reward model trained on preference pairs.

The pairs are read as ``turnrl sft`` reads demonstrations (JSONL or a local Hugging Face
dataset, ``turnrl/sft/preference.py``) and held out as it holds them out (``split``, the
loss every ``reward.eval_every`` steps or at each checkpoint).

    read + check the pairs -> a score head on the base model (``model.name``) -> split
    -> held-out loss and accuracy before -> each step: ``reward.pair_batch_size`` pairs
    (a pure function of run.seed and the step, as ``turnrl sft``'s batches) -> Bradley-Terry
    loss -> AdamW step -> held-out loss and accuracy when due -> checkpoint

The run directory is the model: ``run.out_dir`` holds its weights, tokenizer and
``turnrl_reward_model.json`` (``--reward.model RUN_DIR`` loads it), with ``rm_state.pt``
(the optimiser and the step) for ``--resume``; each file is replaced atomically, the state
last, so a killed run resumes from its last whole checkpoint's step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from turnrl.config import Config, ConfigError
from turnrl.demos.data import DataError
from turnrl.devices import resolve_device
from turnrl.metrics import MetricsLogger, TrainProgress, print_table
from turnrl.models import load_model
from turnrl.rewards.model import METADATA, RewardModel, render_conversation, tokenizer_fingerprint
from turnrl.sft.preference import Pair, bradley_terry_loss, read_pairs
from turnrl.sft.train import split, step_indices
from turnrl.trainer.run import prepare_run_dir

STATE = "rm_state.pt"


@dataclass
class RmResult:
    run_dir: Path
    steps: int
    train_pairs: int
    held_out_pairs: int
    before: dict[str, float] | None
    """Held-out ``loss`` and ``accuracy`` before training (None: nothing held out)."""
    after: dict[str, float] | None


def score_head_model(cfg: Config):
    """(a sequence-classification model with one score, its tokenizer) on ``model.name``'s
    base: the causal LM's body, a fresh score head seeded by ``run.seed``."""
    from transformers import AutoModelForSequenceClassification
    lm, tokenizer = load_model(cfg.model.name, cache_dir=cfg.model.cache_dir or None,
                               revision=cfg.model.revision)
    facts = {k: v for k, v in lm.config.to_dict().items() if k not in ("id2label", "label2id")}
    config = lm.config.__class__.from_dict({**facts, "num_labels": 1,
                                            "pad_token_id": tokenizer.pad_token_id})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.run.seed)
        model = AutoModelForSequenceClassification.from_config(config)
    body = getattr(model, model.base_model_prefix)
    body.load_state_dict(getattr(lm, lm.base_model_prefix).state_dict())
    return model, tokenizer


@torch.no_grad()
def pair_metrics(rm: RewardModel, pairs: list[Pair]) -> dict[str, float] | None:
    """Held-out Bradley-Terry ``loss`` and ``accuracy`` (share of pairs scored chosen >
    rejected) over ``pairs`` (None when there are none)."""
    if not pairs:
        return None
    chosen = rm.score([render_conversation(rm.tokenizer, p.chosen) for p in pairs])
    rejected = rm.score([render_conversation(rm.tokenizer, p.rejected) for p in pairs])
    return {"loss": float(bradley_terry_loss(chosen, rejected)),
            "accuracy": float((chosen > rejected).float().mean())}


def pair_update(rm: RewardModel, optimizer: torch.optim.Optimizer, pairs: list[Pair],
                max_grad_norm: float) -> dict[str, float]:
    """One AdamW step on the batch's Bradley-Terry loss."""
    rm.model.train()
    optimizer.zero_grad(set_to_none=True)
    texts = [render_conversation(rm.tokenizer, m) for p in pairs for m in (p.chosen, p.rejected)]
    scores = rm.forward(texts)
    chosen, rejected = scores[0::2], scores[1::2]
    loss = bradley_terry_loss(chosen, rejected)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(rm.model.parameters(),
                                                max_grad_norm or float("inf")))
    if math.isfinite(norm):
        optimizer.step()
    else:  # a NaN/inf loss or gradient: never step on it
        warnings.warn(f"optimiser step skipped: the gradient norm is {norm}", stacklevel=2)
    rm.model.eval()
    chosen, rejected = chosen.detach(), rejected.detach()
    return {"rm/loss": float(loss.detach()), "rm/accuracy": float((chosen > rejected).float().mean()),
            "rm/margin": float((chosen - rejected).mean()), "grad_norm": norm}


def save_reward_model(run_dir: Path, rm: RewardModel, optimizer, state: dict, base: str) -> None:
    """Weights, tokenizer, metadata and ``STATE`` into ``run_dir``, each file replaced
    atomically, ``STATE`` last."""
    staging = run_dir / ".saving"
    shutil.rmtree(staging, ignore_errors=True)
    rm.model.save_pretrained(staging)
    rm.tokenizer.save_pretrained(staging)
    (staging / METADATA).write_text(json.dumps(
        {"tokenizer": tokenizer_fingerprint(rm.tokenizer), "base": base, "num_labels": 1}))
    torch.save({**state, "optimizer": optimizer.state_dict()}, staging / STATE)
    for name in sorted(os.listdir(staging), key=lambda n: n == STATE):
        os.replace(staging / name, run_dir / name)
    staging.rmdir()


def train_reward_model(cfg: Config, *, resume: bool = False) -> RmResult:
    """Train a reward model on ``reward.data`` for ``run.steps`` steps (module docstring)."""
    if not cfg.reward.data:
        raise DataError("turnrl rm needs --data FILE.jsonl: preference pairs, one a line: "
                        '{"prompt": ..., "chosen": ..., "rejected": ...} (or a local '
                        "Hugging Face dataset with those columns)")
    pairs = read_pairs(cfg.reward.data)  # a malformed file stops before anything starts
    cfg, _ = prepare_run_dir(cfg, resume)
    run_dir = Path(cfg.run.out_dir)
    if not resume and (run_dir / STATE).exists():
        raise ConfigError(f"'{run_dir}' already holds a reward model; pass --resume to "
                          "continue it or choose another --run.out_dir")
    torch.manual_seed(cfg.run.seed)
    model, tokenizer = score_head_model(cfg)
    state = torch.load(run_dir / STATE, weights_only=False) if resume else {"step": 0}
    if resume:
        from transformers import AutoModelForSequenceClassification
        model = AutoModelForSequenceClassification.from_pretrained(run_dir, dtype=torch.float32)
    rm = RewardModel(model.to(resolve_device(cfg.model.device)), tokenizer,
                     batch_size=cfg.reward.batch_size, max_tokens=cfg.reward.max_tokens)
    optimizer = torch.optim.AdamW(rm.model.parameters(), lr=cfg.optim.lr,
                                  weight_decay=cfg.optim.weight_decay)
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    train_ids, held_ids = split(len(pairs), cfg.reward.eval_fraction, cfg.run.seed)
    train, held = [pairs[i] for i in train_ids], [pairs[i] for i in held_ids]
    before = state.get("before") or pair_metrics(rm, held)
    print(f"rm: {len(train)} pairs to train on, {len(held)} held out" + (
        f"; held-out loss {before['loss']:.4f}, accuracy {before['accuracy']:.3f}"
        if before else ""))
    after = run_steps(cfg, rm, optimizer, train, held, {**state, "before": before})
    if before and after:
        print_table("held-out preference pairs", ["", "loss", "accuracy"],
                    [["before", f"{before['loss']:.4f}", f"{before['accuracy']:.3f}"],
                     [f"after {cfg.run.steps} steps", f"{after['loss']:.4f}",
                      f"{after['accuracy']:.3f}"]])
    return RmResult(run_dir, cfg.run.steps, len(train), len(held), before, after)


def run_steps(cfg: Config, rm: RewardModel, optimizer, train: list[Pair], held: list[Pair],
              state: dict) -> dict[str, float] | None:
    """The steps from ``state["step"]`` to ``run.steps``: update, held-out metrics when due,
    metrics.jsonl, the progress bar, checkpoints; the last held-out metrics."""
    run_dir, start = Path(cfg.run.out_dir), state["step"]
    held_metrics = state.get("after")
    every = cfg.run.checkpoint_every
    eval_every = cfg.reward.eval_every or every  # as turnrl sft's sft.eval_every
    with MetricsLogger(run_dir) as logger, TrainProgress(
            cfg.run.steps, description="rm", start_step=start,
            enabled=cfg.run.progress) as progress:
        for step in range(start, cfg.run.steps):
            batch = [train[i] for i in step_indices(len(train), cfg.reward.pair_batch_size,
                                                    step, cfg.run.seed)]
            metrics = pair_update(rm, optimizer, batch, cfg.optim.max_grad_norm)
            done = step + 1
            if held and (done == cfg.run.steps or (eval_every and done % eval_every == 0)):
                held_metrics = pair_metrics(rm, held)
                metrics.update({f"eval/{k}": v for k, v in held_metrics.items()})
            logger.log(step, metrics)
            progress.update(done, loss=metrics["rm/loss"],
                            held_out=held_metrics and held_metrics["accuracy"])
            if done == cfg.run.steps or (every and done % every == 0):
                save_reward_model(run_dir, rm, optimizer,
                                  {**state, "step": done, "after": held_metrics},
                                  cfg.model.name)
    return held_metrics
