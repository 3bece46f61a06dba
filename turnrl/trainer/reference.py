"""Periodic reference resets for prolonged RL (ProRL: Liu et al. 2025, "ProRL: Prolonged
Reinforcement Learning Expands Reasoning Boundaries in Large Language Models",
arXiv:2505.24864, section 2.2).

With a KL penalty the policy is held near a reference; over a long run that anchor grows
stale, the penalty dominates the loss and learning stalls. ProRL hard-resets the reference to
the current policy every so often and restarts the optimiser's state. ``algo.reference_reset_every
N``: after steps N, 2N, ... the reference's weights become a copy of the policy's and AdamW's
moments (and its step count, so bias correction restarts too) are dropped. Departure: ProRL
resets when validation stalls, by hand; here the interval is fixed.

A resumed run must continue with the reference it had: a checkpoint holds the last reset's
reference under ``reference-NNNNNN`` (the step of that reset), linked rather than copied when
its bytes are already there (``checkpoint.save_checkpoint``'s ``frozen``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from turnrl.checkpoint import CheckpointError, load_frozen
from turnrl.trainer.rl_step import Learner


def last_reset(steps_done: int, every: int) -> int:
    """The step count at which the reference was last reset after ``steps_done`` steps
    (0: never, it is the initial model)."""
    return 0 if every <= 0 else steps_done // every * every


def frozen_name(reset_step: int) -> str:
    return f"reference-{reset_step:06d}"


@torch.no_grad()
def reset_reference(learner: Learner, steps_done: int, every: int) -> dict[str, float]:
    """After step ``steps_done`` (counted from 1): when one is due, the reference becomes the
    policy and the optimiser restarts. The step's metric ``update/reference_reset``."""
    if learner.ref_model is None or every <= 0 or steps_done % every:
        return {}
    policy = dict(learner.model.state_dict())
    for name, tensor in learner.ref_model.state_dict().items():
        tensor.copy_(policy[name])
    learner.optimizer.state.clear()  # AdamW re-creates moments and step count at its next step
    return {"update/reference_reset": 1.0}


def frozen_reference(learner: Learner, steps_done: int, every: int) -> dict[str, torch.nn.Module]:
    """What a checkpoint after ``steps_done`` steps must hold of the reference: the last
    reset's copy ({} before the first reset: the reference is the initial model, rebuilt
    from it on resume)."""
    reset = last_reset(steps_done, every)
    if not reset or learner.ref_model is None:
        return {}
    return {frozen_name(reset): learner.ref_model}


def restore_reference(checkpoint: Path, learner: Learner, steps_done: int, every: int) -> None:
    """Load the last reset's reference from ``checkpoint`` (a run resumed after a reset)."""
    reset = last_reset(steps_done, every)
    if not reset or learner.ref_model is None:
        return
    if not load_frozen(checkpoint, frozen_name(reset), learner.ref_model):
        raise CheckpointError(f"checkpoint {checkpoint} holds no {frozen_name(reset)} (the KL "
                              f"reference reset at step {reset}): it was trained with another "
                              "algo.reference_reset_every; resume with that one")
