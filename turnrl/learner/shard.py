"""How a model is split over the learner ranks.

``fsdp``: FSDP2's ``fully_shard`` on each decoder layer, then on the root (the embeddings,
the final norm and the LM head, tied or not, in one group): every parameter, its gradient and
its AdamW moments live as 1/N row blocks (DTensors) on the N ranks, and a layer's whole
weights exist only while it runs. LoRA: the base weights and the adapter's are sharded alike
(the base frozen, so it carries no gradient or moments). Gradients are summed across ranks,
not averaged (``set_gradient_divide_factor(1)``): each rank's loss is already its share of
the global batch's (``learner/share.py``).

``ddp``: every rank keeps the whole model; ``share.py`` sums the gradients in one
all-reduce per optimiser step.

Either way every rank starts from rank 0's weights (one broadcast), so a LoRA adapter
initialised from each process's own random stream cannot differ.
"""

from __future__ import annotations

import types
from itertools import chain

import torch
from torch import nn

from turnrl.config import ConfigError, LearnerConfig
from turnrl.learner.world import World, mark_sharded

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP wraps one by one: the longest ``ModuleList`` whose entries are
    all of one class and hold parameters ([] if the model has none)."""
    best: list[nn.Module] = []
    for module in model.modules():
        if (isinstance(module, nn.ModuleList) and len(module) > len(best)
                and len({type(m) for m in module}) == 1
                and any(True for _ in module.parameters())):
            best = list(module)
    return best


def fsdp_layers(model: nn.Module) -> list[nn.Module]:
    """``decoder_layers(model)``; none is a one-line ``ConfigError`` naming the fix."""
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(f"learner.strategy fsdp: {type(model).__name__} has no repeated "
                          "decoder layers (an nn.ModuleList of one block class) to shard one "
                          "by one; use --learner.strategy ddp")
    return layers


def broadcast_weights(model: nn.Module, world: World) -> None:
    """Every rank's parameters and buffers set to rank 0's (before sharding)."""
    with torch.no_grad():
        for tensor in chain(model.parameters(), model.buffers()):
            world.broadcast(tensor.data)


def shard(model: nn.Module, world: World, cfg: LearnerConfig) -> nn.Module:
    """``model`` split over ``world`` as ``cfg.strategy`` says, in place; returns it. Call
    ``broadcast_weights`` first. A model FSDP cannot wrap is a one-line ``ConfigError`` (rank 0
    refuses it before any rank starts: ``trainer/ranks.py:check_wrappable``)."""
    if world.strategy == "fsdp":
        _fully_shard(model, cfg)
    mark_sharded(model, world)
    return model


def _fully_shard(model: nn.Module, cfg: LearnerConfig) -> None:
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    layers = fsdp_layers(model)
    precision = MixedPrecisionPolicy(param_dtype=DTYPES.get(cfg.param_dtype),
                                     reduce_dtype=DTYPES.get(cfg.reduce_dtype))
    offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mp_policy=precision, offload_policy=offload)
    fully_shard(model, mp_policy=precision, offload_policy=offload)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # sums, not means: see the module docstring
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            module.set_gradient_divide_factor(1.0)
    # TurnRL scores only the policy tokens (the decoder, then the LM head on the rows it
    # needs), never through ``forward``: this method runs such a function under the root's
    # FSDP hooks, which gather the root's weights and reduce their gradients.
    model.through_root = types.MethodType(_call, model)
    register_fsdp_forward_method(model, "through_root")


def _call(self: nn.Module, fn, *args, **kwargs):
    return fn(*args, **kwargs)


def through_root(model: nn.Module, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, under ``model``'s FSDP root hooks when it is sharded (a
    function that calls its submodules rather than its ``forward``)."""
    call = getattr(model, "through_root", None)
    return fn(*args, **kwargs) if call is None else call(fn, *args, **kwargs)


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
