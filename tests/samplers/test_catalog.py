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


def test_every_rollout_sampler_has_one_factory_and_every_listed_sampler_names_it():
    """The chooser builds every ``rollout.sampler`` but auto (which times those it builds)
    from one registry; each ``turnrl samplers`` line names the entry that builds it."""
    import typing

    from turnrl.config.core import RolloutConfig
    from turnrl.samplers.chooser import FACTORIES

    names = set(typing.get_args(typing.get_type_hints(RolloutConfig)["sampler"]))
    assert set(FACTORIES) | {"auto"} == names
    assert {entry.factory for entry in SAMPLERS} == names


@pytest.mark.parametrize("sampler", ["hf", "ct2"])
def test_a_rollout_worker_builds_its_sampler_through_the_chooser(sampler):
    """Seeded with the worker's seed; ct2 starts at version -1 with its background refresh,
    hf samples the worker's own model (its version set when the worker starts)."""
    from turnrl.distributed.worker_engines import sampling_seed
    from turnrl.distributed.workers import worker_sampler

    if sampler == "ct2":
        pytest.importorskip("ctranslate2")
    cfg = load_config(None, TINY + ["--run.mode", "async", "--rollout.sampler", sampler,
                                    "--run.seed", "5"])
    policy, model, engine, refresh = worker_sampler(cfg, 2, None)
    try:
        assert (model is None) == (sampler == "ct2") and (refresh is None) == (sampler == "hf")
        assert engine.describe().startswith(sampler)
        if sampler == "ct2":
            assert engine.version == -1
        assert engine.generator.initial_seed() == sampling_seed(5, 2)
    finally:
        if refresh is not None:
            refresh.close()
