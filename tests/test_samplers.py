"""Which sampler runs is said in one line at start-up, and `turnrl samplers` lists them all."""

from __future__ import annotations

import importlib.util

import pytest

from turnrl.cli import main
from turnrl.config import load_config
from turnrl.policy import load_policy
from turnrl.samplers.catalog import SAMPLERS

TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3"]


@pytest.mark.parametrize("matmul, forward_pass", [
    ("torch", "transformers' pass"),
    ("onednn", "lean pass"),
])
def test_the_sampler_line_names_engine_dtype_device_and_pass(capsys, matmul, forward_pass):
    load_policy(load_config(None, TINY + ["--sampler.matmul", matmul]))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sampler:")]
    assert lines == [f"sampler: hf float32 on cpu ({forward_pass})"]


def test_a_lora_model_says_it_samples_on_the_packed_tree_and_why(capsys):
    pytest.importorskip("peft")
    load_policy(load_config(None, TINY + ["--sampler.matmul", "onednn", "--model.lora.r", "2"]))
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("sampler:"))
    assert line.startswith("sampler: hf float32 on cpu (PackedLinear tree; no lean pass: ")
    assert "no model.layers" in line  # the adapter wraps the model: the lean pass cannot reach it


def test_a_caller_that_replaces_the_sampler_prints_no_line(capsys):
    load_policy(load_config(None, TINY), announce=False)
    assert "sampler:" not in capsys.readouterr().out


def test_turnrl_samplers_lists_each_with_what_this_machine_can_run(capsys):
    assert main(["samplers"]) == 0
    out = capsys.readouterr().out
    for entry in SAMPLERS:
        assert entry.name in out
    has_ct2 = importlib.util.find_spec("ctranslate2") is not None
    ct2_line = next(line for line in out.splitlines() if line.startswith("ct2 "))
    assert ct2_line.endswith("yes") == has_ct2
    assert next(line for line in out.splitlines()
                if line.startswith("hf (transformers' pass)")).endswith("yes")


def test_turnrl_samplers_refuses_arguments(capsys):
    assert main(["samplers", "hf"]) == 2
    assert "takes no arguments" in capsys.readouterr().err
