"""One training client's LoRA adapter with its Adam optimiser, and sampling from saved
adapters. Log-probabilities come from TurnRL's own learner scoring
(``trainer.step.score_policy_tokens``), so ``forward`` equals what a TurnRL update sees, and
sampling re-scores what it drew with the same function (the token-in-token-out guarantee:
the log-probs ``sample`` returns are a fresh forward pass of the weights it sampled with).

Departures from Tinker: the adapter's alpha is fixed at 32 (Tinker's documented default)
and the unembedding gets no adapter (PEFT's 'all-linear' leaves the output layer out), so
``train_unembed`` is accepted and has no effect; ``train_attn``/``train_mlp`` choose the
attention and MLP projections.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from turnrl.config.lora_plan import LoraSpec
from turnrl.lora import adapter_state, add_adapter, load_adapter_state, trainable_parameters
from turnrl.tinker.losses import INPUTS, LOSSES, loss_config
from turnrl.tinker.wire import Datum
from turnrl.trainer.step import score_policy_tokens
from turnrl.types import Batch

LORA_ALPHA = 32.0
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def lora_targets(model: nn.Module, attn: bool, mlp: bool) -> tuple[str, ...]:
    """The linear layer names an adapter covers for Tinker's train_attn / train_mlp."""
    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
               if isinstance(m, nn.Linear)}
    wanted = (ATTN if attn else ()) + (MLP if mlp else ())
    targets = tuple(t for t in wanted if t in present)
    if not targets:
        raise ValueError("the LoRA config trains no layer of this model: set train_attn or "
                         f"train_mlp (its linear layers: {', '.join(sorted(present))})")
    return targets


def score(model: nn.Module, rows: Sequence[list[int]], pad_id: int) -> list[torch.Tensor]:
    """log p(row[t] | row[:t]) for t >= 1 of each row ([len(row) - 1] each), through TurnRL's
    learner scoring; grad flows when enabled."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    device = next(model.parameters()).device
    loss_mask = mask.float()
    loss_mask[:, 0] = 0
    zeros = torch.zeros(ids.shape)
    batch = Batch(ids, mask, loss_mask, zeros, torch.zeros(len(rows))).to(device)
    logprobs, _ = score_policy_tokens(model, batch, 1.0)
    return [logprobs[i, :len(r) - 1] for i, r in enumerate(rows)]


def datum_row(datum: Datum) -> list[int]:
    """The sequence a datum scores: its input plus the last target, when ``target_tokens`` is
    the input shifted by one (how every Tinker recipe builds a datum)."""
    targets = datum.inputs.get("target_tokens")
    if targets is None:
        raise ValueError("loss_fn_inputs lacks 'target_tokens' (one target per input token)")
    targets = targets.long().tolist()
    if len(targets) != len(datum.tokens) or targets[:-1] != datum.tokens[1:]:
        raise ValueError("target_tokens must be model_input shifted left by one token, as "
                         "long as model_input (datum_from_tokens builds them so)")
    return datum.tokens + targets[-1:]


class TrainingModel:
    """A base model copy wearing one client's LoRA adapter, and that adapter's Adam."""

    def __init__(self, base: nn.Module, pad_id: int, rank: int, seed: int | None,
                 attn: bool = True, mlp: bool = True, targets: tuple[str, ...] = ()):
        spec = LoraSpec(r=rank, alpha=LORA_ALPHA, dropout=0.0,
                        target_modules=targets or lora_targets(base, attn, mlp))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0 if seed is None else seed)
            self.model = add_adapter(copy.deepcopy(base), spec)
        self.model.train(False)  # no dropout: scoring is deterministic
        self.spec, self.pad_id = spec, pad_id
        self.optimizer: torch.optim.AdamW | None = None
        self.steps = 0

    def forward_backward(self, data: list[Datum], loss_fn: str, given: Mapping | None,
                         forward_only: bool) -> tuple[list[dict[str, torch.Tensor]], dict]:
        """Per-datum ``logprobs`` and ``elementwise_loss``, and ``loss:sum``; gradients are
        added to the adapter's unless ``forward_only``."""
        config = loss_config(loss_fn, given)
        for i, datum in enumerate(data):
            missing = [k for k in INPUTS[loss_fn] if k not in datum.inputs]
            if missing:
                raise ValueError(f"datum {i}: loss '{loss_fn}' needs loss_fn_inputs "
                                 f"{', '.join(missing)}")
        rows = [datum_row(d) for d in data]
        with torch.set_grad_enabled(not forward_only):
            logprobs = score(self.model, rows, self.pad_id)
            losses = [LOSSES[loss_fn](lp, _on(d.inputs, lp.device), config)
                      for lp, d in zip(logprobs, data, strict=True)]
            total = torch.stack([loss.sum() for loss in losses]).sum()
            if not forward_only:
                total.backward()
        outputs = [{"logprobs": lp.detach(), "elementwise_loss": loss.detach()}
                   for lp, loss in zip(logprobs, losses, strict=True)]
        return outputs, {"loss:sum": float(total.detach())}

    def optim_step(self, lr: float, betas: tuple[float, float], eps: float,
                   weight_decay: float, grad_clip_norm: float) -> dict[str, float]:
        """One AdamW step with the client's parameters on the adapter, then zero the grads."""
        params = trainable_parameters(self.model)
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(params, lr=lr)
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        metrics = {}
        if grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip_norm)
            metrics["grad_norm"] = float(norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return metrics

    def adapter(self) -> dict[str, torch.Tensor]:
        """A copy of the adapter's tensors (what a sampler loads)."""
        return {k: v.clone() for k, v in adapter_state(self.model).items()}

    def state(self) -> dict:
        """Adapter and optimiser, for save_state."""
        return {"adapter": self.adapter(), "steps": self.steps, "rank": self.spec.r,
                "targets": self.spec.target_modules,
                # a deep copy: the live state_dict shares the moment tensors later steps change
                "optimizer": None if self.optimizer is None
                else copy.deepcopy(self.optimizer.state_dict())}

    def load_state(self, state: dict, with_optimizer: bool) -> None:
        load_adapter_state(self.model, state["adapter"])
        self.optimizer = None
        if with_optimizer and state["optimizer"] is not None:
            self.optimizer = torch.optim.AdamW(trainable_parameters(self.model))
            # a copy again: load_state_dict keeps the given tensors, which steps change in place
            self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
            self.steps = state["steps"]


def _on(inputs: Mapping[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in inputs.items()}
