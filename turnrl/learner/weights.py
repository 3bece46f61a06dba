"""The published weights of a model that may be sharded over learner ranks.

``turnrl.lora.published_state`` gives a whole model's (the adapter alone for LoRA). A model
whose weights are FSDP shards gives them through here: rank 0 calls these, the other ranks
gather in step with it (``world.gathered``: one whole tensor at a time).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from turnrl.learner.world import gathered, world_of
from turnrl.lora import get_peft_model_state, is_lora
from turnrl.lora import published_state as whole_published_state


def sharded(model: nn.Module) -> bool:
    """Whether ``model``'s weights are FSDP shards spread over learner ranks."""
    world = world_of(model)
    return world is not None and world.strategy == "fsdp"


def published_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``turnrl.lora.published_state``, whole even from FSDP shards."""
    return dict(published_pairs(model)) if sharded(model) else whole_published_state(model)


def published_pairs(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``published_state`` one tensor at a time: from FSDP shards, each gathered whole in
    turn (every learner rank in step)."""
    if not sharded(model):
        yield from whole_published_state(model).items()
        return
    state = get_peft_model_state(model) if is_lora(model) else model.state_dict()
    yield from gathered(state, world_of(model))
