"""Async training through the endpoint: the official openai client plays the tiny model behind a
live server while the learner trains; stale groups are dropped and counted, never trained."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from turnrl.config import ConfigError, load_config
from turnrl.models import tiny_model
from turnrl.serve.train import train_agent


async def rollout(client, task) -> float:
    """Two calls (the second extends the first), a pause between them so that agents are
    still playing while the learner trains; reward: the replies' mean character code over
    128 (continuous: a group's rewards differ, so every update has a gradient)."""
    messages = [{"role": "user", "content": task}]
    first = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    await asyncio.sleep(0.05)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Once more."}]
    second = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    text = (first.choices[0].message.content or "") + (second.choices[0].message.content or "")
    return sum(map(ord, text)) / max(len(text), 1) / 128


def test_async_training_through_the_client_bounds_staleness_and_counts_drops(tmp_path):
    bound = 1
    cfg = load_config(None, [
        "--model.name", "tiny", "--run.out_dir", str(tmp_path / "run"), "--run.steps", "4",
        "--rollout.group_size", "2", "--rollout.groups_per_step", "1", "--serve.port", "0",
        "--run.mode", "async", "--serve.groups_in_flight", "6",
        "--staleness.max_versions", str(bound), "--run.progress", "false",
        "--optim.lr", "1e-2", "--run.tensorboard", "false"])
    versions = []

    async def watched(client, task):  # the version the server samples with, as clients see it
        versions.append((await client.models.list()).data[0].policy_version)
        return await rollout(client, task)

    before = {k: v.clone() for k, v in tiny_model(seed=0)[0].state_dict().items()}
    result = train_agent(watched, ["Say a digit.", "Name a number.", "Count to three."], cfg,
                         eval_tasks=["Say a digit."] * 4)
    assert len(result.rewards) == 4
    # Six groups start at version 0 and one is trained a step: those still buffered when the
    # learner is two versions ahead are dropped, none trained.
    assert len(result.staleness) == 4 and max(result.staleness) <= bound
    assert result.dropped, "no group was dropped"
    assert max(versions) >= 2 and 0 in versions  # agents played on while weights moved
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert all(x["async/staleness_max"] <= bound for x in lines)
    assert sum(x["async/dropped_groups"] for x in lines) == len(result.dropped)
    assert all(x["grad_norm"] > 0 for x in lines)
    # Step 2 trains a group sampled by version 0 with the learner at version 1: the update
    # weighs it by proximal / recorded behaviour probabilities, which now differ.
    assert lines[1]["async/staleness_max"] == 1 and lines[1]["offpolicy/ess"] < 1 - 1e-6
    assert result.before is not None and result.after is not None and result.table
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000004" / "model.safetensors"
    from safetensors.torch import load_file
    after = load_file(str(checkpoint))
    assert any(not torch.equal(after[k], before[k]) for k in after if k in before)


def test_async_mode_refuses_resume_and_regenerate(tmp_path):
    cfg = load_config(None, ["--model.name", "tiny", "--run.mode", "async",
                             "--run.out_dir", str(tmp_path / "r")])
    with pytest.raises(ConfigError, match="async run starts afresh"):
        train_agent(rollout, ["x"], cfg, resume=True)
    regen = load_config(None, ["--model.name", "tiny", "--run.mode", "async",
                               "--staleness.on_stale", "regenerate", "--serve.port", "0",
                               "--run.out_dir", str(tmp_path / "r2")])
    with pytest.raises(ConfigError, match="on_stale drop"):
        train_agent(rollout, ["x"], regen)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_train_agent_refuses_a_turn_level_estimator_before_serving(tmp_path, mode):
    """The level comes from the registry, not from the shape of the advantages once a step
    has been played."""
    cfg = load_config(None, ["--model.name", "tiny", "--run.mode", mode,
                             "--algo.advantage", "turn_gae", "--serve.port", "0",
                             "--run.out_dir", str(tmp_path / "r")])
    with pytest.raises(ConfigError, match="turn_gae is turn-level"):
        train_agent(rollout, ["x"], cfg)
    assert not (tmp_path / "r").exists()  # refused before the run directory was made
