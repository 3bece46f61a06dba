"""The evaluation maths on small exact cases and on simulated data with a known truth."""

import itertools
import math

import numpy as np
import pytest

from turnrl.evaluation import (
    SampledEval,
    aggregate_seeds,
    compare,
    episode_transcript,
    paired_difference,
)
from turnrl.stats import (
    bootstrap_mean_interval,
    mcnemar_exact,
    pass_at_k,
    sign_flip_test,
    student_t_quantile,
    t_interval,
    wilson_interval,
)
from turnrl.types import Episode

SIMULATIONS = 2000


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 9])
def test_pass_at_k_equals_exact_enumeration_of_k_subsets(n):
    """pass@k is the share of size-k subsets of the n samples holding a correct one."""
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            exact = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


@pytest.mark.parametrize("df,expected", [(1, 12.7062), (2, 4.3027), (4, 2.7764),
                                         (9, 2.2622), (30, 2.0423)])
def test_student_t_quantile_matches_tables(df, expected):
    assert student_t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)


def test_mcnemar_exact_hand_values():
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)  # 2 * (1/2)^5
    assert mcnemar_exact(3, 9) == pytest.approx(2 * (1 + 12 + 66 + 220) / 4096)
    assert mcnemar_exact(4, 4) == 1.0 and mcnemar_exact(0, 0) == 1.0


def test_sign_flip_on_zero_one_differences_is_mcnemar():
    diffs = [1] * 3 + [-1] * 9 + [0] * 20
    assert sign_flip_test(diffs) == pytest.approx(mcnemar_exact(3, 9))


def _beta_pass_at_k(a: float, b: float, k: int) -> float:
    """True pass@k of a task population with per-task success p ~ Beta(a, b):
    1 - E[(1-p)^k] = 1 - B(a, b + k) / B(a, b)."""
    log_beta = lambda x, y: math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)  # noqa: E731
    return 1.0 - math.exp(log_beta(a, b + k) - log_beta(a, b))


def _simulated(rng, tasks, samples, a=1.0, b=3.0, label="sim"):
    p = rng.beta(a, b, size=tasks)
    return SampledEval(label, list(range(tasks)), list(rng.binomial(samples, p)), samples,
                       0.0, 0.0, 0.0, 0.0, {"done": tasks * samples})


def _coverage(hits: int) -> float:
    return hits / SIMULATIONS


def test_pass_at_k_bootstrap_interval_covers_the_truth_95_percent():
    """Tasks drawn from Beta(1, 3), 8 samples each: the true pass@1 and pass@8 of the task
    population lie in the bootstrap-over-tasks interval in ~95% of simulated evaluations."""
    rng = np.random.default_rng(1)
    truth = {k: _beta_pass_at_k(1.0, 3.0, k) for k in (1, 8)}
    hits = {1: 0, 8: 0}
    for _ in range(SIMULATIONS):
        result = _simulated(rng, tasks=64, samples=8)
        for k in hits:
            e = result.pass_at(k)
            hits[k] += e.lo <= truth[k] <= e.hi
    for k, h in hits.items():
        assert 0.92 <= _coverage(h) <= 0.98, (k, _coverage(h))


def test_wilson_interval_covers_the_truth_95_percent():
    rng = np.random.default_rng(2)
    hits = 0
    for _ in range(SIMULATIONS):
        lo, hi = wilson_interval(int(rng.binomial(64, 0.3)), 64)
        hits += lo <= 0.3 <= hi
    assert 0.92 <= _coverage(hits) <= 0.98


def test_t_interval_over_three_seeds_covers_95_percent():
    """Three training seeds whose pass@1 scatter normally around 0.6: the t-interval covers
    0.6 ~95% of the time (1.96 instead of t_2 = 4.30 would cover only ~80%)."""
    rng = np.random.default_rng(3)
    hits = sum(lo <= 0.6 <= hi for _, lo, hi in
               (t_interval(list(rng.normal(0.6, 0.05, size=3))) for _ in range(SIMULATIONS)))
    assert 0.92 <= _coverage(hits) <= 0.98


def test_paired_difference_interval_covers_95_percent():
    """A's per-task success is B's plus 0.1 (clipped): the interval of the paired difference
    covers the true population difference ~95% of the time."""
    rng = np.random.default_rng(4)
    big = rng.beta(2, 2, size=200_000)
    truth = float(np.mean(np.minimum(big + 0.1, 1.0) - big))
    hits = 0
    for _ in range(SIMULATIONS):
        p = rng.beta(2, 2, size=64)
        a = SampledEval("a", list(range(64)), list(rng.binomial(4, np.minimum(p + 0.1, 1.0))),
                        4, 0, 0, 0, 0, {})
        b = SampledEval("b", list(range(64)), list(rng.binomial(4, p)), 4, 0, 0, 0, 0, {})
        d = paired_difference(a, b)  # the interval compare() reports
        hits += d.lo <= truth <= d.hi
    assert 0.92 <= _coverage(hits) <= 0.98


@pytest.mark.parametrize("samples", [1, 4])
def test_compare_detects_a_real_difference_and_not_a_null_one(samples):
    """Rejection rate at the 5% level: ~5% or less when A and B are the same policy, high
    when A is 25 points better (64 tasks)."""
    rng = np.random.default_rng(5 + samples)
    rejections = {"null": 0, "real": 0}
    runs = 200
    for _ in range(runs):
        p = rng.beta(2, 2, size=64)
        b = SampledEval("b", list(range(64)), list(rng.binomial(samples, p)), samples,
                        0, 0, 0, 0, {})
        same = SampledEval("a", list(range(64)), list(rng.binomial(samples, p)), samples,
                           0, 0, 0, 0, {})
        better = SampledEval("a", list(range(64)),
                             list(rng.binomial(samples, np.minimum(p + 0.25, 1.0))), samples,
                             0, 0, 0, 0, {})
        rejections["null"] += compare(same, b).p_value < 0.05
        rejections["real"] += compare(better, b).p_value < 0.05
    assert rejections["null"] / runs <= 0.08
    assert rejections["real"] / runs >= 0.8
    assert compare(same, b).test.startswith("McNemar" if samples == 1 else "paired sign-flip")


def test_compare_refuses_different_tasks():
    a = SampledEval("a", [1, 2], [1, 0], 1, 0, 0, 0, 0, {})
    b = SampledEval("b", [1, 3], [1, 0], 1, 0, 0, 0, 0, {})
    with pytest.raises(ValueError, match="same tasks"):
        compare(a, b)


def test_aggregate_seeds_uses_the_t_interval_of_seed_means():
    runs = [SampledEval(f"s{i}", [0, 1], [c, 2], 2, 0, 0, 0, 0, {})
            for i, c in enumerate((0, 1, 2))]
    pooled = aggregate_seeds(runs)
    means = [r.pass_at(1).value for r in runs]  # 0.5, 0.75, 1.0
    assert pooled["1"].value == pytest.approx(0.75)
    assert (pooled["1"].lo, pooled["1"].hi) == pytest.approx(t_interval(means)[1:])
    assert "t-interval over 3 seed means" == pooled["1"].method


def test_bootstrap_is_reproducible_and_brackets_the_mean():
    values = [0.0, 1.0, 0.5, 0.25, 1.0]
    first = bootstrap_mean_interval(values)
    assert first == bootstrap_mean_interval(values)
    assert first[1] <= first[0] <= first[2]


def test_transcript_splits_policy_and_env_tokens():
    ep = Episode("e", 7, 0)
    ep.append([1, 2], policy=False)
    ep.append([3], policy=True, logprobs=[-0.1])
    ep.append([4, 5], policy=False)
    t = episode_transcript(ep, lambda ids: ",".join(map(str, ids)))
    assert t["segments"] == [{"role": "env", "text": "1,2"}, {"role": "policy", "text": "3"},
                             {"role": "env", "text": "4,5"}]
    assert t["seed"] == 7


def test_mcnemar_exact_equals_the_binomial_tail_summed_afresh():
    """The tail is built term by term (each coefficient from the last): exactly the sum of
    ``math.comb`` terms, on seeded random counts, large ones included."""
    import math
    import random

    rng = random.Random(58)
    for only_a, only_b in [(rng.randint(0, 400), rng.randint(0, 400)) for _ in range(40)] + [
            (700, 640), (1, 2000), (1024, 1024)]:
        m = only_a + only_b
        tail = sum(math.comb(m, i) for i in range(min(only_a, only_b) + 1))
        assert mcnemar_exact(only_a, only_b) == min(1.0, 2 * tail / 2**m)
