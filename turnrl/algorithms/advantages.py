"""Group-relative advantage estimators for outcome rewards.

Each function maps per-sample scalar rewards ``[N]`` and group ids ``[N]`` (samples drawn for the
same prompt share an id) to per-sample advantages ``[N]``; the trainer broadcasts them over tokens.

Papers:
- GRPO: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), outcome supervision, eq. in sec. 4.1.2.
- Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv:2503.20783).
- RLOO: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization"
  (arXiv:2402.14740).
- REINFORCE++: Hu et al. 2025, "REINFORCE++" (arXiv:2501.03262), the "with baseline" variant.
- RAE: Liu et al. 2025, "SPIRAL" (arXiv:2506.24119); a baseline per (game, role) kept across
  steps, so it is the one stateful estimator here (``rae_advantages``).

Departures:
- DeepSeekMath writes ``std(r)`` without saying which; we use the *sample* std (Bessel's
  correction, ``n - 1``), as common open GRPO implementations do. Every std here is a sample std,
  and a set of one element has std 0 (not NaN).
- GRPO and REINFORCE++ add ``eps`` to the std so all-equal groups/batches give advantage 0.
- REINFORCE++ (with baseline): ``x = r - group_mean(r)``, then global whitening over the batch,
  ``(x - mean(x)) / (std(x) + eps)``. The batch mean of ``x`` is already 0, so the subtraction
  only guards against rounding. The paper whitens token-level returns that include a KL term; we
  whiten the per-sample scalar (KL, if any, is applied in the loss instead).
"""

from collections.abc import Callable

import torch
from torch import Tensor


def _check(values: Tensor, group_ids: Tensor) -> None:
    if values.dim() != 1 or values.shape != group_ids.shape:
        raise ValueError(
            f"expected 1-D values and group_ids of one shape, got "
            f"{tuple(values.shape)} and {tuple(group_ids.shape)}"
        )


def _float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.float()


def _group_sum(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group sums ``[G]``, counts ``[G]`` and each element's group index ``[N]``."""
    _check(values, group_ids)
    # unique() relabels arbitrary (non-contiguous) ids to 0..G-1.
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = values.new_zeros(counts.numel()).index_add_(0, inv, values)
    return sums, counts.to(values.dtype), inv


def group_mean(values: Tensor, group_ids: Tensor) -> Tensor:
    """Mean of each element's group, broadcast back. values ``[N]`` float, group_ids ``[N]`` long
    -> ``[N]``."""
    sums, counts, inv = _group_sum(values, group_ids)
    return (sums / counts)[inv]


def group_std(values: Tensor, group_ids: Tensor) -> Tensor:
    """Sample std (``n - 1``) of each element's group, broadcast back; singletons get 0.
    values ``[N]``, group_ids ``[N]`` -> ``[N]``."""
    dev = values - group_mean(values, group_ids)
    ss, counts, inv = _group_sum(dev * dev, group_ids)
    # Singletons have ss == 0, so clamping the divisor to 1 yields std 0 instead of 0/0.
    return (ss / (counts - 1).clamp(min=1)).sqrt()[inv]


def grpo_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO (Shao et al. 2024): ``(r - mean_g) / (std_g + eps)``. ``[N], [N] -> [N]``."""
    r = _float(rewards)
    return (r - group_mean(r, group_ids)) / (group_std(r, group_ids) + eps)


def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO (Liu et al. 2025): ``r - mean_g``, no std division. ``[N], [N] -> [N]``."""
    r = _float(rewards)
    return r - group_mean(r, group_ids)


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024): ``r_i - mean_{j != i, j in g} r_j``; singletons get 0.
    ``[N], [N] -> [N]``."""
    r = _float(rewards)
    sums, counts, inv = _group_sum(r, group_ids)
    n = counts[inv]
    # Leave-one-out mean is (S - r_i) / (n - 1); for n == 1 use r_i itself so the result is 0.
    loo = torch.where(n > 1, (sums[inv] - r) / (n - 1).clamp(min=1), r)
    return r - loo


def reinforce_pp_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ with baseline (Hu et al. 2025): ``x = r - mean_g``, then
    ``(x - mean(x)) / (std(x) + eps)`` over the whole batch (sample std). ``[N], [N] -> [N]``."""
    x = dr_grpo_advantages(rewards, group_ids)
    whole = torch.zeros_like(group_ids)  # one group = the batch
    return (x - group_mean(x, whole)) / (group_std(x, whole) + eps)


RAE_DECAY = 0.95
"""SPIRAL's baseline decay alpha."""


def rae_advantages(rewards: Tensor, keys: list[str], baselines: dict[str, float],
                   decay: float = RAE_DECAY) -> tuple[Tensor, dict[str, float]]:
    """Role-conditioned advantage estimation (RAE; Liu et al. 2025, "SPIRAL: Self-Play on
    Zero-Sum Games Incentivizes Reasoning via Multi-Agent Multi-Turn Reinforcement
    Learning", arXiv:2506.24119): ``A = r - b[key]`` with one baseline per (game, role)
    ``key``, an exponential average of that key's returns, ``b <- decay * b + (1 - decay) * r``.

    rewards ``[N]``, keys (one per episode), baselines (key -> value; a new key starts at 0)
    -> (advantages ``[N]``, the updated baselines; the input dict is not changed).

    Departures: SPIRAL updates the baseline trajectory by trajectory; here every advantage of
    a batch uses the baseline from before the batch, and a key seen ``n`` times in the batch
    moves by ``b <- decay^n b + (1 - decay^n) mean(r)``: the same as ``n`` sequential updates
    when the ``n`` returns are equal, and independent of the episodes' order always.
    """
    r = _float(rewards)
    if r.dim() != 1 or len(keys) != r.shape[0]:
        raise ValueError(f"expected 1-D rewards and one key per reward, got "
                         f"{tuple(r.shape)} and {len(keys)} keys")
    if not 0 <= decay < 1:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    advantages = r - torch.tensor([baselines.get(k, 0.0) for k in keys], dtype=r.dtype)
    updated = dict(baselines)
    for key in dict.fromkeys(keys):
        mine = r[[i for i, k in enumerate(keys) if k == key]]
        keep = decay ** len(mine)
        updated[key] = keep * baselines.get(key, 0.0) + (1 - keep) * float(mine.mean())
    return advantages, updated


ADVANTAGE_FNS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}
