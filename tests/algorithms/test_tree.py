"""Tree-GRPO advantages (turnrl/algorithms/tree.py) against values worked out by hand."""

import math

import pytest
import torch

from turnrl.algorithms.advantages import grpo_advantages
from turnrl.algorithms.tree import tree_grpo_advantages


def test_one_fork_two_trees_by_hand():
    """Group of two trees, each forked after turn 1 into 2 leaves; returns A: 1, 0 and B: 0, 0.

    Root group: mean 0.25, sample std sqrt(0.75 / 3) = 0.5. Tree A's trunk: V = 0.5, so
    (0.5 - 0.25) / 0.5 = 0.5; tree B's trunk -0.5. Leaf A0's turn 2: root term
    (1 - 0.25) / 0.5 = 1.5, branch term (1 - 0.5) / std(1, 0) = 0.5 / 0.7071 = 0.7071."""
    out = tree_grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long),
                               [0, 0, 1, 1], [((1, 0),), ((1, 1),), ((1, 0),), ((1, 1),)],
                               [2, 2, 2, 2])
    half = 1 / math.sqrt(2)
    expected = [[0.5, 1.5 + half], [0.5, -0.5 - half], [-0.5, -0.5], [-0.5, -0.5]]
    for got, want in zip(out, expected, strict=True):
        assert got.tolist() == pytest.approx(want, abs=1e-5)


def test_two_fork_levels_compare_each_fork_s_children():
    """One tree, forks after turns 1 and 2 (k = 2): leaves 00, 01, 10, 11 return 1, 1, 1, 0.

    Root group = the 4 leaves: mean 0.75, std sqrt(0.75 / 3) = 0.5. Turn 1 (the trunk, a root
    node): (0.75 - 0.75) / 0.5 = 0. Turn 2 of node 1 (leaves 10, 11; V = 0.5): branch term
    against the trunk's leaves (0.5 - 0.75) / 0.5 = -0.5, root term (0.5 - 0.75) / 0.5 = -0.5.
    Turn 3 of leaf 11: branch term against its fork's leaves (1, 0): (0 - 0.5) / 0.7071,
    root term (0 - 0.75) / 0.5 = -1.5."""
    paths = [((1, 0), (2, 0)), ((1, 0), (2, 1)), ((1, 1), (2, 0)), ((1, 1), (2, 1))]
    out = tree_grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long),
                               [7] * 4, paths, [3, 3, 3, 3])
    half = 1 / math.sqrt(2)
    assert out[3].tolist() == pytest.approx([0.0, -1.0, -half - 1.5], abs=1e-5)
    assert out[0].tolist() == pytest.approx([0.0, 1.0, 0.5], abs=1e-5)
    assert out[2].tolist() == pytest.approx([0.0, -1.0, half + 0.5], abs=1e-5)


def test_without_forks_it_is_grpo_on_every_turn():
    rewards, groups = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0]), torch.tensor([0, 0, 0, 1, 1])
    out = tree_grpo_advantages(rewards, groups, [0, 1, 2, 0, 1], [()] * 5, [3, 1, 2, 1, 4])
    want = grpo_advantages(rewards, groups)
    for leaf, turns in enumerate(out):
        assert torch.allclose(turns, want[leaf].repeat(len(turns)))


def test_an_episode_that_ended_before_its_fork_is_a_one_leaf_tree():
    """Leaf 2 ended at turn 1 (no fork): its turn gets the root term only, and the other
    tree's siblings are compared with each other alone."""
    out = tree_grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.zeros(3, dtype=torch.long),
                               [0, 0, 1], [((1, 0),), ((1, 1),), ()], [2, 2, 1])
    root = grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.zeros(3, dtype=torch.long))
    assert out[2].tolist() == pytest.approx([float(root[2])], abs=1e-6)
    assert out[0][1] - out[1][1] == pytest.approx(float(root[0] - root[1]) + 2 / math.sqrt(2),
                                                  abs=1e-5)


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="one entry per leaf"):
        tree_grpo_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), [0], [(), ()],
                             [1, 1])
