"""Sharded checkpoints: the model's and optimiser's state through ``torch.distributed.checkpoint``.

Why DCP: under ``fsdp`` no rank holds a whole weight, so no rank can write today's
``model.safetensors`` without first gathering the model (its bytes, and the time of a
gather). With DCP every rank writes its own shards at once, and the reader plans by tensor
name and offset, so a checkpoint written by N ranks loads at any M (one process without a
process group included), resharded as it is read.

Layout, directly in the checkpoint directory: ``.metadata`` (DCP's index of every tensor's
shape, dtype and chunks; written last by rank 0, so its presence marks a whole DCP write) and
``__R_0.distcp`` for each rank R that wrote data. Keys are fully qualified parameter names
(``get_state_dict``), the same whether the model is FSDP2-sharded, a ``ddp`` replica or plain:
``model.<name>`` for the weights, ``optimizer.state.<name>.<exp_avg|exp_avg_sq|step>`` and
``optimizer.param_groups`` for AdamW. A ``ddp`` model's replicated tensors are written once.

LoRA: only the trainable tensors (the adapter) and their moments are saved, as today's
adapter checkpoints: the frozen base is the run's ``model.name``, reloaded from there; PEFT's
``adapter_config.json`` lies beside the shards, naming the checkpoint's kind.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from turnrl.lora import ADAPTER_CONFIG, adapter_config_dict, is_lora

METADATA = ".metadata"
MODEL = "model"
OPTIMIZER = "optimizer"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` holds a DCP checkpoint (its ``.metadata``)."""
    return (Path(path) / METADATA).is_file()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def _one_process_quiet():
    """DCP warns that it assumes one process whenever no process group exists, even when
    told so (``no_dist``): one process is a case this module means."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's shard; a plain tensor itself): touching a
    DTensor's values otherwise starts a collective."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def first_nonfinite(named) -> str | None:
    """The name of the first floating tensor of ``named`` ((name, value) pairs; this rank's
    shards only) holding NaN or inf, or None."""
    for name, value in named:
        if torch.is_tensor(value) and value.is_floating_point():
            local = _local(value)
            if not (bool(torch.isfinite(local.sum())) or bool(torch.isfinite(local).all())):
                return name
    return None


def _flat(state: dict, prefix: str = ""):
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _require_finite_everywhere(state: dict) -> None:
    """Every rank refuses together when any rank's shard holds NaN or inf, so no rank writes
    a checkpoint the others abandoned."""
    bad = first_nonfinite(_flat(state))
    flag = torch.tensor([0.0 if bad is None else 1.0])
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        where = bad or "another rank's shard"
        raise FloatingPointError(f"refusing to write a checkpoint: {where} has non-finite "
                                 "values; resume from the previous checkpoint with a lower "
                                 "optim.lr or a smaller optim.max_grad_norm")


def save_sharded(directory: str | Path, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
    """Write ``model``'s and ``optimizer``'s state as one DCP checkpoint into ``directory``.

    Called on every rank at once (or by one process alone); each rank writes its own shards,
    rank 0 the ``.metadata`` after gathering every rank's write results, so no rank returns
    before all files are written. LoRA: the adapter's tensors alone (the module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    directory = Path(directory)
    lora = is_lora(model)
    weights, moments = get_state_dict(model, optimizer,
                                      options=StateDictOptions(ignore_frozen_params=lora))
    if lora:  # ignore_frozen_params keeps a frozen tied weight's second name (lm_head)
        trainable = {name for name, param in model.named_parameters(remove_duplicate=False)
                     if param.requires_grad}
        weights = {name: value for name, value in weights.items() if name in trainable}
    state = {MODEL: weights, OPTIMIZER: moments}
    _require_finite_everywhere(state)
    with _one_process_quiet():
        dcp.save(state, checkpoint_id=directory, no_dist=not dist.is_initialized())
    if lora and _rank() == 0:
        from turnrl import safe_json

        config = {**adapter_config_dict(model), "base_model_name_or_path": ""}
        (directory / ADAPTER_CONFIG).write_text(safe_json.dumps(config, indent=2) + "\n")


def saved_model_keys(directory: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The weights a DCP checkpoint holds: parameter name -> (shape, dtype)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    prefix = f"{MODEL}."
    return {key[len(prefix):]: (meta.size, meta.properties.dtype)
            for key, meta in metadata.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}


def _wanted(model: nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """``model``'s state dict (this rank's shards) restricted to what the checkpoint holds;
    every weight of a full fine-tune, every adapter weight of LoRA must be there."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    mine = get_model_state_dict(model)
    saved = saved_model_keys(directory)
    needed = [k for k in mine if "lora_" in k] if is_lora(model) else list(mine)
    missing = [k for k in needed if k not in saved]
    extra = [k for k in saved if k not in mine]
    if missing or extra:
        raise ValueError(f"the checkpoint's weights do not fit this model (missing "
                         f"{missing[:2]}, unexpected {extra[:2]}): load it with the model and "
                         "model.lora it was trained with")
    return {k: v for k, v in mine.items() if k in saved}


def load_sharded(directory: str | Path, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
    """A ``save_sharded`` checkpoint into ``model`` (and ``optimizer``) in place.

    Called on every rank at once, at any world size, or by one process without a process
    group; the model FSDP2-sharded, a ``ddp`` replica or plain: each rank reads the chunks
    that overlap its own shards, so the state is resharded as it is read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    directory = Path(directory)
    state = {MODEL: _wanted(model, directory)}
    if optimizer is not None:
        # DCP fills existing tensors: a fresh AdamW gets its moments by one zero step (lr 0),
        # which a gradient left over would skip
        optimizer.zero_grad(set_to_none=True)
        state[OPTIMIZER] = get_optimizer_state_dict(model, optimizer)
    with _one_process_quiet():
        dcp.load(state, checkpoint_id=directory, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state[MODEL], options=StateDictOptions(strict=False))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[OPTIMIZER])


def full_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's whole weights in a DCP checkpoint (the adapter's alone for LoRA), by
    parameter name, read in this one process (no process group needed): for export, eval
    and serve."""
    import torch.distributed.checkpoint as dcp

    weights = {name: torch.empty(shape, dtype=dtype)
               for name, (shape, dtype) in saved_model_keys(path).items()}
    with _one_process_quiet():
        dcp.load({MODEL: weights}, checkpoint_id=Path(path), no_dist=True)
    return weights


def load_whole(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict,
               optimizer_state: dict) -> None:
    """A whole (unsharded) state, as today's checkpoints hold it, into a sharded ``model``
    and ``optimizer`` on every rank: ``weights`` by parameter name (a tied weight saved once
    fills each name it has), ``optimizer_state`` torch's index-keyed ``state_dict`` whose
    indices count ``model``'s trainable parameters in order (``make_optimizer``)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    weights = _with_tied_names(model, weights)
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    by_name = {
        "state": {names[i]: moments for i, moments in optimizer_state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                         for group in optimizer_state["param_groups"]]}
    whole = StateDictOptions(full_state_dict=True, strict=not is_lora(model))
    set_model_state_dict(model, weights, options=whole)
    set_optimizer_state_dict(model, optimizer, by_name, options=whole)
    for group, saved in zip(optimizer.param_groups, optimizer_state["param_groups"],
                            strict=True):  # the hyperparameters as saved: betas a tuple again
        group.update({k: v for k, v in saved.items() if k != "params"})


def _with_tied_names(model: nn.Module, weights: dict) -> dict:
    """``weights`` with every name of a shared tensor (tied embeddings) that safetensors
    saved under one of them."""
    names: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    weights = dict(weights)
    for group in names.values():
        present = [n for n in group if n in weights]
        for name in group:
            if present and name not in weights:
                weights[name] = weights[present[0]]
    return weights
