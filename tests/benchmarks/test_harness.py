"""``benchmarks/harness.py``: alternation order, medians, intervals and the report lines."""

import re
import sys

import harness
import pytest


def test_rounds_alternate_and_flip_reverses_every_other_round():
    assert harness.round_order(["a", "b"], 3) == ["a", "b", "a", "b", "a", "b"]
    assert harness.round_order(["a", "b", "c"], 2, flip=True) == ["a", "b", "c", "c", "b", "a"]
    assert harness.round_order(["a", "b"], 0) == []


def test_alternate_warms_each_variant_up_then_runs_them_in_turn():
    calls: list[str] = []
    variants = {name: (lambda name=name: calls.append(name) or len(calls)) for name in "ab"}
    rounds = harness.alternate(variants, rounds=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "a", "b", "a", "b"]
    assert rounds.order == ["a", "b", "a", "b", "a", "b"]
    assert rounds.results == {"a": [3, 5, 7], "b": [4, 6, 8]}
    assert {len(v) for v in (*rounds.wall.values(), *rounds.cpu.values())} == {3}
    assert all(t >= 0 for times in rounds.wall.values() for t in times)


def test_alternate_repeat_divides_the_round_time_by_the_calls():
    calls: list[str] = []
    rounds = harness.alternate({"a": lambda: calls.append("a")}, rounds=2, warmup=0, repeat=4)
    assert len(calls) == 8 and len(rounds.wall["a"]) == 2


def test_medians_by_hand():
    rounds = harness.Rounds(wall={"a": [3.0, 1.0, 2.0], "b": [4.0, 1.0, 2.0, 3.0]},
                            cpu={"a": [5.0, 5.0, 1.0], "b": [0.5]})
    assert rounds.medians() == {"a": 2.0, "b": 2.5}
    assert rounds.medians("cpu") == {"a": 5.0, "b": 0.5}


def test_percentile_interpolates_between_ranks():
    assert harness.percentile([4, 1, 3, 2], 50) == 2.5
    assert harness.percentile([1, 2, 3, 4], 0) == 1 and harness.percentile([1, 2, 3, 4], 100) == 4
    assert harness.percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)
    with pytest.raises(ValueError, match="no values"):
        harness.percentile([], 50)


def test_ratios_spread_and_round_ratios_by_hand():
    assert harness.ratio_of_medians([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]) == 2.0
    assert harness.round_ratios([2.0, 3.0], [1.0, 6.0]) == [2.0, 0.5]
    assert harness.spread([3.0, 1.0, 2.0]) == (1.0, 3.0)
    assert harness.ratio_of_medians([1.0], [0.0]) != harness.ratio_of_medians([1.0], [0.0])  # NaN


def test_bootstrap_interval_is_a_point_when_every_round_agrees_and_covers_the_ratio():
    assert harness.bootstrap_ratio([2.0] * 5, [1.0] * 5) == (2.0, 2.0)
    a, b = [1.0, 2.0, 3.0], [1.0, 1.0, 1.0]
    # Every resample's median is one of the values, so a 100% interval spans their extremes.
    assert harness.bootstrap_ratio(a, b, level=1.0) == (1.0, 3.0)
    low, high = harness.bootstrap_ratio([1.0, 1.1, 0.9, 1.2, 1.0], [2.0, 2.1, 1.9, 2.0, 2.2])
    assert low <= 0.5 <= high and high - low < 0.2
    assert harness.bootstrap_ratio(a, b, seed=3) == harness.bootstrap_ratio(a, b, seed=3)
    with pytest.raises(ValueError, match="paired rounds; got 3 and 2"):
        harness.bootstrap_ratio(a, [1.0, 1.0])


def test_cpu_model_from_cpuinfo_text():
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags : avx2\n"
    assert harness.cpu_model(x86) == "AMD EPYC 7B13"
    assert harness.cpu_model("processor : 0\nCPU part : 0xd0c\n") == "0xd0c"
    assert harness.cpu_model("processor : 0\n") == "unknown CPU"


def test_machine_line_format():
    line = harness.machine_line("AMD EPYC 7B13", 2, 2, 1.5, 1.834, "2026-11-27 14:03 UTC")
    assert line == ("machine: AMD EPYC 7B13, 2 cores, torch 2 threads, load 1.50 -> 1.83, "
                    "2026-11-27 14:03 UTC")
    assert "torch not loaded" in harness.machine_line("x", 1, None, 0, 0, "d")


def test_machine_reads_this_machine():
    line = harness.machine(harness.load_average())
    assert re.fullmatch(r"machine: .+, \d+ cores, torch (\d+ threads|not loaded), "
                        r"load \d+\.\d\d -> \d+\.\d\d, \d{4}-\d\d-\d\d \d\d:\d\d UTC", line), line


def test_ratio_and_interval_lines():
    assert harness.ratio_line("bwrap / fallback median latency", 1.234) == \
        "ratio: bwrap / fallback median latency = 1.23"
    assert harness.ratio_line("turnrl/trl", "n/a (TRL not run)") == "ratio: turnrl/trl = n/a (TRL not run)"
    line = harness.interval_line("b / a", [2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    assert line == "b / a = 2.00 [2.00, 2.00] (95% bootstrap over 3 rounds; rounds 2.00-2.00)"


def test_command_returns_stdout_and_names_a_failing_command():
    assert harness.command([sys.executable, "-c", "print('hi')"])() == "hi\n"
    failing = harness.command([sys.executable, "-c", "import sys; sys.exit('boom')"])
    with pytest.raises(harness.HarnessError, match=r"exited 1: boom$"):
        failing()
    rounds = harness.alternate({"child": harness.command([sys.executable, "-c", "pass"])}, 1, 0)
    assert rounds.cpu["child"][0] > 0  # a child's CPU time counts
