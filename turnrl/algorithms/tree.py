"""Tree-GRPO advantages over the leaves of tree rollouts (``rollout.branch``).

Paper: Ji et al. 2025, "Tree Search for LLM Agent Reinforcement Learning" (Tree-GRPO,
arXiv:2509.21240): an agent's episodes fork at step boundaries, leaves that share a prefix
form a group; a leaf's advantage adds its *intra-tree* group-relative advantage to its
*inter-tree* one (over every leaf of the prompt's trees). TreeRL (Hou et al. 2025, "TreeRL:
LLM Reinforcement Learning with On-Policy Tree Search") writes the same two terms per node: ``V(n) - V(parent)`` (local) plus
``V(n) - V(root)`` (global), ``V`` the mean return of the leaves below a node.

Here, for each turn of a leaf, in the node ``n`` of the tree the turn belongs to (the
stretch between two forks):

    A(turn) = (V(n) - mean_P(R)) / (std_P(R) + eps)      branch term; 0 at a root node
            + (V(n) - mean_G(R)) / (std_G(R) + eps)      root-group term

``P`` = the leaves below ``n``'s parent fork (the siblings sharing the prefix up to that fork,
and everything below them), ``G`` = every leaf of the episode's GRPO group (all trees of its
seed). Stds are sample stds (``n - 1``), 0 for one leaf, as in ``advantages.py``.

Departures:
- Tree-GRPO trains each leaf as a whole sequence, so a shared prefix's tokens are in every
  leaf's row, each copy with that leaf's advantage. Here a prefix's tokens are trained once
  (in its first leaf, rollout/branch.py) with the *mean* of its leaves' advantages, which is
  the formula above (the branch terms of siblings sum to zero, so a root node keeps only the
  root-group term). The gradient direction is the paper's; a prefix token's weight in a
  token-mean loss is 1 where the paper's is the number of leaves below it.
- The intra-tree group is the siblings under each fork (per fork level), not the whole tree:
  with one fork level the two are the same.
- Forks are at chosen turns for every episode (``rollout.branch.turns``), not at randomly
  sampled nodes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from turnrl.algorithms.advantages import grpo_advantages

Path = tuple[tuple[int, int], ...]
"""The forks above a leaf, root first: ``(turn, child)``, the leaf took continuation ``child``
of the fork after ``turn``."""


def _std(values: Tensor) -> float:
    return float(values.std()) if values.numel() > 1 else 0.0


def tree_grpo_advantages(rewards: Tensor, group_ids: Tensor, roots: Sequence[Hashable],
                         paths: Sequence[Path], turn_counts: Sequence[int],
                         eps: float = 1e-6) -> list[Tensor]:
    """Per-turn advantages of each leaf (see the module docstring).

    rewards ``[N]`` (each leaf's return), group_ids ``[N]``, roots (the tree each leaf grew
    from: one id per tree of its group), paths (its forks), turn_counts (its turns)
    -> one ``[turn_counts[i]]`` float32 tensor per leaf. Without forks (every path empty)
    every turn gets its episode's GRPO advantage.
    """
    r = rewards.float()
    if not (len(r) == len(group_ids) == len(roots) == len(paths) == len(turn_counts)):
        raise ValueError("rewards, group_ids, roots, paths and turn_counts need one entry "
                         "per leaf")
    root_term = grpo_advantages(r, group_ids, eps)
    below: dict[tuple, list[int]] = {}  # node -> the leaves under it
    for i, path in enumerate(paths):
        for depth in range(len(path) + 1):
            below.setdefault((int(group_ids[i]), roots[i], tuple(path[:depth])), []).append(i)
    out = []
    for i, path in enumerate(paths):
        turns = []
        for turn in range(1, turn_counts[i] + 1):
            depth = sum(fork_turn < turn for fork_turn, _ in path)
            node = below[(int(group_ids[i]), roots[i], tuple(path[:depth]))]
            value = float(root_term[node].mean())
            if depth:
                parent = r[below[(int(group_ids[i]), roots[i], tuple(path[:depth - 1]))]]
                value += (float(r[node].mean()) - float(parent.mean())) / (_std(parent) + eps)
            turns.append(value)
        out.append(torch.tensor(turns, dtype=torch.float32))
    return out
