"""The template-collapse estimators, against hand-computed values."""

import math

import pytest
import torch

from turnrl.algorithms.collapse import mi_proxy, retrieval_accuracy


def test_mi_proxy_matches_the_infonce_formula_by_hand():
    scores = torch.tensor([[-1.0, -3.0], [-2.0, -2.5]])
    own = torch.tensor([0, 1])
    expected = [-1.0 - math.log((math.exp(-1.0) + math.exp(-3.0)) / 2),
                -2.5 - math.log((math.exp(-2.0) + math.exp(-2.5)) / 2)]
    assert mi_proxy(scores, own).tolist() == pytest.approx(expected, abs=1e-6)
    assert expected[0] > 0 > expected[1]  # a reply likelier elsewhere counts against


def test_mi_proxy_is_zero_when_every_prompt_scores_alike_and_at_most_log_p():
    alike = torch.full((3, 4), -2.7)
    assert mi_proxy(alike, torch.tensor([0, 1, 3])).tolist() == [0.0, 0.0, 0.0]
    # each reply infinitely likelier under its own prompt: the bound log P
    apart = torch.full((4, 4), -1e4).fill_diagonal_(-1.0)
    assert mi_proxy(apart, torch.arange(4)).tolist() == pytest.approx([math.log(4)] * 4)


def test_mi_proxy_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"scores must be \[R, P\] and own \[R\]"):
        mi_proxy(torch.zeros(3, 2), torch.zeros(2, dtype=torch.long))


def test_retrieval_accuracy_counts_own_prompt_strictly_best():
    scores = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-3.0, -0.5]])
    # row 0 retrieved; row 1 a tie (a miss); row 2's own prompt (0) loses
    assert float(retrieval_accuracy(scores, torch.tensor([0, 1, 0]))) == pytest.approx(1 / 3)
