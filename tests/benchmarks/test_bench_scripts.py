"""Benchmark scripts: `benchmarks/speed/env_threads.py` end to end, briefly; `async_throughput.py`'s schedule;
`responses_latency.py` on the tiny model."""

from __future__ import annotations

import re

import env_threads
import pytest
import responses_latency
import torch


def test_shared_and_own_env_threads_side_by_side(capsys):
    assert env_threads.main(["--latencies", "0", "--rounds", "1", "--seconds", "1"]) == 0
    out = capsys.readouterr().out
    rows = {way: float(n) for way, n in re.findall(r"(shared|own threads)\s+(\d+) rows/s", out)}
    assert set(rows) == {"shared", "own threads"} and all(n > 0 for n in rows.values()), out
    ratio = re.search(r"^ratio: shared / own threads rows per second at 0 ms = (\S+)$", out, re.M)
    # Printed rows/s are rounded to whole rows: the ratio agrees to within that rounding.
    assert ratio and abs(float(ratio.group(1)) - rows["shared"] / rows["own threads"]) < 0.03


def test_async_throughput_repeats_alternate_the_latency_order():
    """``benchmarks/speed/async_throughput.py --repeats``: every other repeat runs the latencies
    backwards, so a drifting machine weighs on each alike."""
    import async_throughput

    assert async_throughput._schedule([0.0, 500.0], 3) == [
        (0, 0.0), (0, 500.0), (1, 500.0), (1, 0.0), (2, 0.0), (2, 500.0)]
    assert async_throughput._schedule([0.0, 500.0], 1) == [(0, 0.0), (0, 500.0)]


@pytest.mark.parametrize("study, names", [("reset", ["no_kl", "kl", "kl_reset"]),
                                           ("replay", ["grpo", "replay"])])
def test_the_prolonged_training_studies_print_their_methods_and_ratio(capsys, tmp_path, study,
                                                                      names):
    import prolonged

    assert prolonged.main(["--study", study, "--seeds", "1", "--steps", "2", "--every", "1",
                           "--episodes", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^(\S+)\s+([\d.]+)\s+\[", out, re.M)
    assert [name for name, _ in rows] == names, out
    assert all(0 <= float(rate) <= 1 for _, rate in rows)
    assert re.search(rf"^ratio: {names[-1]} / {names[-2]} held-out success = \S+$", out, re.M)


def test_responses_latency_times_both_apis_and_prints_the_ratio(capsys):
    runs = responses_latency.main(["--tokens", "3", "--repeats", "2",
                                   "--threads", str(torch.get_num_threads())])
    assert set(runs) == {"chat completions", "responses"}
    assert all(len(seen) == 2 and all(0 < first <= whole for first, whole in seen)
               for seen in runs.values())
    out = capsys.readouterr().out
    assert re.search(r"^ratio: responses / chat first-token seconds = \d+\.\d\d$", out, re.M), out


def test_collapse_cost_times_the_monitor_beside_the_update(capsys):
    """``benchmarks/speed/collapse_cost.py`` on the tiny model, one small round."""
    import collapse_cost

    assert collapse_cost.main(["--groups", "2", "--prompt", "8", "--policy", "4",
                               "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    # two turns per episode: 2 first-turn contexts + 16 second-turn ones, capped at 8
    assert "monitor 8 replies x 8 contexts" in out, out
    ratio = re.search(r"^ratio: collapse / update cpu = (\S+)$", out, re.M)
    assert ratio and float(ratio.group(1)) > 0


@pytest.mark.slow
def test_ragen_frozenlake_prints_each_protocol_beside_ragens_quoted_figure(capsys, tmp_path):
    """``benchmarks/learning/ragen_frozenlake.py`` on the tiny model, two seeds a protocol."""
    import ragen_frozenlake

    assert ragen_frozenlake.main(["--model", "tiny", "--episodes", "2", "--tokens", "3",
                                  "--also-plain",
                                  "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^(ragen|plain 4x4)\s+tiny\s+([\d.]+)% \[", out, re.M)
    assert [name for name, _ in rows] == ["ragen", "plain 4x4"], out
    assert re.search(r"^ragen\s+18-21%\s+<- RAGEN .*not run here$", out, re.M), out
    assert "--env.options.protocol ragen" in out
