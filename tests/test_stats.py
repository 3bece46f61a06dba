import math

import pytest

from turnrl.stats import format_rate, mean_interval, pass_at_k, wilson_interval

# Literals below were worked out by hand from the Wilson formula with z = 1.96, n = 10:
# z^2 = 3.8416, denominator 1 + z^2/n = 1.38416.


def test_wilson_zero_successes():
    # centre = half = 0.19208 / 1.38416, so lo = 0 and hi = 0.38416 / 1.38416.
    lo, hi = wilson_interval(0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12)
    assert hi == pytest.approx(0.277541, abs=1e-5)


def test_wilson_half():
    # centre = 0.69208 / 1.38416 = 0.5; half = 1.96 * sqrt(0.034604) / 1.38416.
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.236590, abs=1e-5)
    assert hi == pytest.approx(0.763410, abs=1e-5)


def test_wilson_all_successes_mirrors_zero():
    lo, hi = wilson_interval(10, 10)
    assert lo == pytest.approx(0.722459, abs=1e-5)
    assert hi == pytest.approx(1.0, abs=1e-12)


def test_wilson_no_trials_is_uninformative():
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize("successes,n", [(-1, 10), (11, 10), (0, -1)])
def test_wilson_rejects_impossible_counts(successes, n):
    with pytest.raises(ValueError):
        wilson_interval(successes, n)


def test_wilson_narrows_with_more_trials():
    small = wilson_interval(5, 10)
    large = wilson_interval(500, 1000)
    assert large[1] - large[0] < small[1] - small[0]


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (5, 2, 1, 0.4),  # pass@1 is just c/n
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 0, 1, 0.0),
        (5, 0, 5, 0.0),
        (5, 5, 1, 1.0),
        (5, 5, 5, 1.0),
        (5, 4, 2, 1.0),  # only one wrong sample: any pair holds a correct one
        (10, 3, 3, 1 - 35 / 120),  # C(7,3)/C(10,3)
    ],
)
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_large_n_is_stable():
    # C(1000, 100) overflows a float; the product form must not.
    value = pass_at_k(1000, 10, 100)
    assert 0.0 < value < 1.0
    assert math.isfinite(value)


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError):
        pass_at_k(5, 2, 6)


@pytest.mark.parametrize("n,c,k", [(5, 6, 1), (5, -1, 1), (5, 2, 0)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_mean_interval():
    # mean 2, sample std 1, half-width 1.96 / sqrt(3) = 1.131607.
    mean, lo, hi = mean_interval([1.0, 2.0, 3.0])
    assert mean == pytest.approx(2.0)
    assert lo == pytest.approx(0.868393, abs=1e-5)
    assert hi == pytest.approx(3.131607, abs=1e-5)


def test_mean_interval_single_value_has_no_width():
    assert mean_interval([0.25]) == (0.25, 0.25, 0.25)


def test_mean_interval_constant_values():
    assert mean_interval([3.0, 3.0, 3.0, 3.0]) == pytest.approx((3.0, 3.0, 3.0))


def test_mean_interval_empty_is_an_error():
    with pytest.raises(ValueError):
        mean_interval([])


def test_format_rate():
    assert format_rate(5, 10) == "50.0% [23.7, 76.3]"
    assert format_rate(0, 10) == "0.0% [0.0, 27.8]"
    assert format_rate(0, 0) == "n/a [0.0, 100.0]"
