"""``benchmarks/speed/step_throughput.py`` end to end on the tiny model: TurnRL always, TRL when it is installed.

One thread per worker: on a shared 2-core machine two spinning threads per process make the
tiny model's many small ops very slow, and these tests check wiring, not speed.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import step_throughput as bench

RATIO = re.compile(r"^ratio: turnrl/trl completion tokens per second = (\S+)$")


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_turnrl_side_and_scaling(capsys, tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--systems", "turnrl", "--groups", "4", "--threads", "1",
                       "--json", str(out)]) == 0
    lines = _lines(capsys)
    text = "\n".join(lines)
    assert re.search(r"^turnrl\s+\d+\.\d+\s+\d+\.\d", text, re.M), text
    assert not re.search(r"^trl\s", text, re.M)
    assert "TurnRL scaling" in text
    assert "TurnRL against the hardware" in text
    assert re.search(r"^G=4 gen\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\dx", text, re.M), text
    assert re.search(r"^G=4 update\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\dx", text, re.M), text
    for label in ("group size 2", "completion length 8", "turns 2 (guess-number)"):
        assert label in text
    assert lines[-1] == "ratio: turnrl/trl completion tokens per second = n/a (TRL not run)"

    report = json.loads(out.read_text())
    turnrl = report["workloads"][0]["systems"]["turnrl"]
    # Exactly L tokens per completion: no early stop.
    assert turnrl["completion_tokens_per_step"] == 4 * 16
    assert turnrl["completion_len_range"] == [16, 16]
    assert turnrl["median_step_s"] > 0 and turnrl["peak_rss_mb"] > 0
    assert report["rates"]["read_gb_s"] > 0 and report["rates"]["fp32_gflops"] > 0
    floors = report["workloads"][0]["floors"]
    assert 0 < floors["gen_floor_s"] < turnrl["median_gen_s"]  # a floor, never above the time
    assert 0 < floors["update_floor_s"] < turnrl["median_update_s"]
    # the sync trainer's stages, publish included (an engine with its own weights reloads)
    assert set(turnrl["records"][0]["stages_s"]) == {"collect", "advantages", "update", "log",
                                                      "publish"}
    turns = {r["label"]: r for r in report["scaling"]}
    assert turns["turns 2 (guess-number)"]["turns"] > 1  # the multi-turn rows really are


def test_turnrl_side_with_the_ct2_sampler(tmp_path):
    """``--engine ct2``: TurnRL samples with CTranslate2 int8 (the learner stays float32) and
    each step has a publish stage, where the sampler takes the updated weights."""
    pytest.importorskip("ctranslate2")
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--systems", "turnrl", "--groups", "4", "--threads", "1",
                       "--no-scaling", "--no-limits", "--engine", "ct2", "--engine-dtype", "int8",
                       "--json", str(out)]) == 0
    turnrl = json.loads(out.read_text())["workloads"][0]["systems"]["turnrl"]
    assert turnrl["completion_tokens_per_step"] == 4 * 16
    assert turnrl["completion_len_range"] == [16, 16]  # ct2 stops on stop tokens only
    assert all("publish" in record["stages_s"] for record in turnrl["records"])


def test_turnrl_and_trl_side_by_side(capsys, tmp_path):
    # make test installs the bench extra, so TRL is always there: no skip.
    out = tmp_path / "bench.json"
    # The scaling and hardware tables are test_turnrl_side_and_scaling's: left out here.
    assert bench.main(["--quick", "--groups", "2", "4", "--no-scaling", "--no-limits",
                       "--threads", "1", "--json", str(out)]) == 0
    lines = _lines(capsys)
    text = "\n".join(lines)
    for system in ("turnrl", "trl"):
        assert re.search(rf"^{system}\s+\d+\.\d+\s+\d+\.\d", text, re.M), text
    assert re.search(r"^ratio \(G=2\): turnrl/trl completion tokens per second = \d", text, re.M)
    assert re.search(r"^ratio \(G=4\): turnrl/trl completion tokens per second = \d", text, re.M)
    assert "minimum over workloads G=2, G=4" in text
    assert "warning" not in text  # same token counts, prompts and threads in both systems
    match = RATIO.match(lines[-1])
    assert match, lines[-1]
    ratio = float(match.group(1))
    assert math.isfinite(ratio) and ratio > 0

    report = json.loads(out.read_text())
    assert report["ratio"] == pytest.approx(ratio, abs=0.01)
    for workload in report["workloads"]:
        trl, turnrl = workload["systems"]["trl"], workload["systems"]["turnrl"]
        group = workload["group_size"]
        assert trl["completion_tokens_per_step"] == turnrl["completion_tokens_per_step"] == group * 16
        assert trl["completion_len_range"] == [16, 16]  # min_new_tokens kept TRL from stopping
        assert trl["prompt_tokens"] == turnrl["prompt_tokens"]  # same prompts, same template
        assert trl["setup"]["generation_batch_size"] == group  # one generation per step


def test_missing_trl_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(bench, "trl_available", lambda: False)
    assert bench.main(["--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install -e '.[bench]'" in err


def test_blocks_alternate_evenly():
    assert bench.split_blocks(4, 2) == [2, 2]
    assert bench.split_blocks(5, 2) == [3, 2]
    assert bench.split_blocks(1, 2) == [1]


def test_trl_batch_matches_turnrl_micro_batches(tmp_path):
    wl = bench.Workload(model_dir=str(tmp_path), group_size=16)
    assert bench.trl_batch_shape(wl, 8) == (8, 2)
    assert bench.trl_batch_shape(bench.Workload(model_dir="", group_size=4), 8) == (4, 1)
    assert bench.trl_batch_shape(bench.Workload(model_dir="", group_size=6), 8) == (6, 1)
    assert bench.trl_batch_shape(bench.Workload(model_dir="", group_size=12), 8) == (6, 2)


def test_trl_prompts_are_turnrl_prompts(tiny):
    """TRL's rows, through its chat-template call, give the token ids TurnRL plays."""
    from turnrl.envs import make_env
    from turnrl.policy import training_seeds
    from turnrl.rollout import ChatFormat, run_sync

    _, tokenizer = tiny
    wl = bench.Workload(model_dir="tiny", group_size=4, prompts=2)
    rows = bench.trl_prompts(wl, steps=2)
    seeds = [seed for step in range(2)
             for seed, _ in training_seeds(bench.turnrl_config(wl), step)[::4]]
    assert len(rows) == len(seeds) == 4
    chat = ChatFormat(tokenizer)
    for row, seed in zip(rows, seeds, strict=True):
        env = make_env("arithmetic")
        _, _, turnrl_ids = chat.start(run_sync(env.reset(seed)))
        trl_ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]
        assert list(trl_ids) == turnrl_ids
        assert row["answer"] == env.answer
        assert bench.arithmetic_reward([[{"role": "assistant", "content": f"= {env.answer}"}]],
                                       [row["answer"]]) == [1.0]
