"""Tinker's built-in losses as pure functions of per-token tensors, summed (not averaged)
over tokens as Tinker defines them: a client scales its advantages or weights itself.

- ``cross_entropy``: ``-sum(weights * logp)`` (supervised learning).
- ``importance_sampling``: ``-sum(exp(logp - sampler_logp) * advantages)``, the REINFORCE
  estimator corrected for the sampler being a different policy (Kahn & Kakade 2002's
  importance weighting as used in off-policy policy gradients).
- ``ppo``: the clipped surrogate of Schulman et al. 2017 ("Proximal Policy Optimization
  Algorithms", eq. 7), ``-sum(min(r A, clip(r, low, high) A))``; departs from the paper in
  taking the clip bounds as Tinker's ``clip_low_threshold``/``clip_high_threshold`` ratios
  (default 0.8 and 1.2) rather than ``1 +- eps``, and in summing over tokens.
Each takes ``logprobs`` [N] (with grad) and the datum's ``inputs`` (name -> [N] tensor) and
returns the per-token loss [N].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
CONFIG = {"cross_entropy": {}, "importance_sampling": {},
          "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}}


def cross_entropy(logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping) -> Tensor:
    """``-weights * logp`` per token; ``weights`` [N] defaults to ones."""
    weights = inputs.get("weights")
    return -logprobs * (torch.ones_like(logprobs) if weights is None else weights)


def importance_sampling(logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping
                        ) -> Tensor:
    """``-exp(logp - sampler_logp) * A`` per token: the gradient is the off-policy
    policy gradient ``-r A grad logp``."""
    ratio = torch.exp(logprobs - inputs["logprobs"])
    return -ratio * inputs["advantages"]


def ppo(logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping) -> Tensor:
    """``-min(r A, clip(r, low, high) A)`` per token (Schulman et al. 2017, eq. 7)."""
    ratio = torch.exp(logprobs - inputs["logprobs"])
    advantages = inputs["advantages"]
    clipped = ratio.clamp(float(config["clip_low_threshold"]), float(config["clip_high_threshold"]))
    return -torch.minimum(ratio * advantages, clipped * advantages)


LOSSES: dict[str, Callable[[Tensor, Mapping[str, Tensor], Mapping], Tensor]] = {
    "cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo}


def loss_config(name: str, given: Mapping[str, float | str] | None) -> dict:
    """``name``'s config: its defaults with ``given`` on top; an unknown key fails naming the
    keys the loss takes."""
    known = CONFIG[name]
    for key in given or {}:
        if key not in known:
            takes = ", ".join(known) or "no options"
            raise ValueError(f"loss_fn_config key '{key}' is not an option of loss '{name}' "
                             f"(it takes {takes})")
    return {**known, **(given or {})}
