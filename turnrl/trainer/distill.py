"""The teacher of on-policy distillation: loaded once, scoring each step's policy tokens.

``load_teacher`` loads ``distill.teacher`` (frozen, eval mode, on the learner's device) and
refuses one whose tokenizer differs from the policy's; ``distill_batch`` scores the batch's
policy tokens under it, batched like the reference model's scoring, and turns the reverse
KL into advantages (``turnrl/algorithms/distill.py``, which also lists where this departs
from GKD and MiniLLM).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import nn

from turnrl.algorithms.distill import mean_reverse_kl, reverse_kl_advantages, with_distillation
from turnrl.config import Config, ConfigError, DistillConfig
from turnrl.models import ModelNotFoundError, load_model
from turnrl.trainer.step import UpdateSettings, batch_logprobs
from turnrl.types import Batch


def load_teacher(cfg: Config, student_tokenizer, device: torch.device) -> nn.Module | None:
    """The frozen teacher model, or None when distillation is off."""
    name = cfg.distill.teacher
    if not name:
        return None
    try:
        teacher, tokenizer = load_model(name, dtype=cfg.model.dtype,
                                        cache_dir=cfg.model.cache_dir or None)
    except ModelNotFoundError as err:
        raise ConfigError(f"distill.teacher: {err}") from None
    check_same_tokenizer(tokenizer, student_tokenizer, name, cfg.model.name)
    teacher.to(device).eval()
    teacher.requires_grad_(False)
    return teacher


def check_same_tokenizer(teacher_tokenizer, student_tokenizer, teacher: str,
                         student: str) -> None:
    """The teacher scores the student's token ids: both must map text to the same ids."""
    theirs, ours = teacher_tokenizer.get_vocab(), student_tokenizer.get_vocab()
    if theirs != ours:
        differ = len(set(theirs.items()) ^ set(ours.items()))
        raise ConfigError(f"distill.teacher '{teacher}' ({len(theirs)} tokens) and model.name "
                          f"'{student}' ({len(ours)} tokens) have different tokenizers "
                          f"({differ} entries differ); the teacher must share the policy's "
                          "tokenizer (same model family)")


@torch.no_grad()
def teacher_logprobs(teacher: nn.Module, batch: Batch, settings: UpdateSettings) -> torch.Tensor:
    """The teacher's log-probabilities of the batch's policy tokens, ``[B, T]`` aligned with
    the token ids like ``old_logprobs`` (0 off the loss mask), at the sampling temperature so
    both policies are compared as the student was sampled."""
    return batch_logprobs(teacher, batch, settings.temperature, settings.optim.micro_batch_size,
                          settings.optim.shared_prefix)


def distill_batch(teacher: nn.Module, batch: Batch, settings: UpdateSettings,
                  cfg: DistillConfig) -> tuple[Batch, dict[str, float]]:
    """``batch`` with the reverse-KL advantages in (added to the task's, or alone); metrics
    ``distill/reverse_kl`` (nats per policy token) and ``distill/teacher_s``.

    The student's log-probabilities are the sampler's (``old_logprobs``): in sync mode the
    episodes were just sampled by the weights about to be updated, so they are the student's
    own, and no extra student pass is needed.
    """
    start = time.perf_counter()
    teacher_lp = teacher_logprobs(teacher, batch, settings)
    seconds = time.perf_counter() - start
    mask = batch.loss_mask
    kl_adv = reverse_kl_advantages(batch.old_logprobs, teacher_lp, mask, cfg.coef, cfg.baseline)
    advantages = with_distillation(batch.advantages, kl_adv, mask, cfg.only)
    metrics = {"distill/reverse_kl": mean_reverse_kl(batch.old_logprobs, teacher_lp, mask),
               "distill/teacher_s": seconds}
    return replace(batch, advantages=advantages), metrics

