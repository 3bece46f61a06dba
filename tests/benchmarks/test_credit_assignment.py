"""The credit-assignment benchmark's analysis: threshold from the optimum, censored episodes
to threshold, t intervals and the closing ratio line."""

import math

import pytest
from credit_assignment import episodes_to, ratio_lines, summarise, threshold_for


def run(method, seed, successes, horizon=16, budget=96):
    """A run whose evaluations at 0, 32, 64, 96 episodes had ``successes`` out of 10."""
    curve = [[32 * i, s, 10] for i, s in enumerate(successes)]
    return {"key": [horizon, method, "", seed], "horizon": horizon, "method": method,
            "tag": "", "seed": seed, "curve": curve, "budget": budget, "cpu_s": 1.0,
            "before": {"successes": successes[0], "episodes": 10},
            "after": {"successes": successes[-1], "episodes": 10}}


def test_threshold_is_halfway_from_the_pooled_start_to_the_optimum():
    thr, start = threshold_for([run("grpo", 0, [2, 3, 4, 5]), run("gigpo", 0, [4, 9, 9, 9])])
    assert start == pytest.approx(0.3) and thr == pytest.approx(0.65)


def test_episodes_to_threshold_skips_the_start_and_never_is_inf():
    assert episodes_to(run("grpo", 0, [9, 3, 7, 8]), 0.65) == 64.0
    assert math.isinf(episodes_to(run("grpo", 0, [9, 3, 4, 5]), 0.65))


def test_summary_censors_at_the_budget_and_the_last_line_is_the_longest_horizon():
    runs = [run("grpo", s, [3, 3, 4, 5 + s]) for s in range(3)]       # > budget, 96, 96
    runs += [run("gigpo", s, [3, 7, 8, 9]) for s in range(3)]         # 32 each
    runs += [run("grpo", s, [3, 7, 8, 9], horizon=4) for s in range(3)]
    runs += [run("gigpo", s, [3, 7, 8, 9], horizon=4) for s in range(3)]
    _, summary = summarise(runs)
    grpo = summary[16]["methods"]["grpo"]
    assert grpo["per_seed"][0] == math.inf and grpo["mean"] == pytest.approx(96.0)
    assert summary[16]["methods"]["gigpo"]["mean"] == pytest.approx(32.0)
    lines = ratio_lines(summary)
    assert lines[0].startswith("horizon 4:") and "ratio 1.00" in lines[0]
    assert "intervals do not overlap" in lines[1]
    assert lines[-1] == "ratio: best hierarchical / grpo episodes to threshold = 0.33"


def test_tuning_grid_gives_every_method_the_same_budget_and_picks_the_best_area():
    from credit_assignment import TUNE_GRID, TUNE_HORIZON, tune_lines

    assert len({len(grid) for grid in TUNE_GRID.values()}) == 1  # an equal budget per method
    assert set(TUNE_GRID) == {"gigpo", "turn_gae", "archer"}
    runs = []
    for i, successes in enumerate([[3, 4, 5, 6], [3, 9, 9, 9], [3, 3, 3, 3], [3, 6, 9, 9]]):
        r = run("gigpo", 100, successes, horizon=TUNE_HORIZON)
        runs.append({**r, "tag": f"tune{i}"})
    lines = tune_lines(runs)
    assert lines[-1] == f"  gigpo     best: {' '.join(TUNE_GRID['gigpo'][1])}"
    assert "episodes to 65.0% (start 30.0%)" in lines[0]
