"""A short training run driven only through the official openai client: agent code plays the
tiny model behind a live server; the recorded calls train it; the served weights change."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from turnrl.config import ConfigError, load_config
from turnrl.models import tiny_model
from turnrl.serve import load_server
from turnrl.serve.train import train_agent


async def rollout(client, task) -> float | None:
    """Two calls per episode (the second extends the first); reward: the reply has a digit,
    plus its length / 100 so a group's rewards differ whatever the tiny random model samples
    (on the digit alone four tied replies gave zero advantages and no update, once in CI)."""
    if task == "silent":
        return None  # an agent that never scores its episode: reported, not trained on
    messages = [{"role": "user", "content": task}]
    first = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Once more."}]
    second = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    text = (first.choices[0].message.content or "") + (second.choices[0].message.content or "")
    return float(any(c.isdigit() for c in text)) + len(text) / 100


def test_a_short_run_through_the_client_trains_the_served_weights(tmp_path):
    cfg = load_config(None, [
        "--model.name", "tiny", "--run.out_dir", str(tmp_path / "run"), "--run.steps", "2",
        "--rollout.group_size", "4", "--rollout.groups_per_step", "2", "--serve.port", "0",
        "--run.progress", "false", "--optim.lr", "1e-2", "--run.tensorboard", "false"])
    versions = set()

    async def watched(client, task):  # the version the server samples with, as clients see it
        versions.add((await client.models.list()).data[0].policy_version)
        return await rollout(client, task)

    before = {k: v.clone() for k, v in tiny_model(seed=0)[0].state_dict().items()}
    result = train_agent(watched, ["Say a digit.", "silent", "Name a number."], cfg)
    assert len(result.rewards) == 2
    assert versions == {0, 1}  # step 2 was played by the weights step 1 updated
    left = {(x["step"], x["reason"]) for x in result.left_out}
    assert (0, "rollout returned None") in left and len(result.left_out) == 4  # step 0, task 1
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert lines[0]["episode/segments"] == 4 and lines[1]["episode/segments"] == 8
    assert lines[0]["episode/turns"] == 2  # both calls of an episode merged into one sequence
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002" / "model.safetensors"
    after = load_file(str(checkpoint))
    changed = [k for k in after if k in before and not torch.equal(after[k], before[k])]
    assert changed, "no weight changed"
    # `turnrl serve --serve.checkpoint DIR` serves the trained weights, tagged with their step.
    served = load_server(load_config(None, ["--model.name", "tiny", "--serve.checkpoint",
                                            str(checkpoint.parent)]))
    assert served.engine.version == 2
    assert torch.equal(served.model.state_dict()[changed[0]], after[changed[0]])


def test_the_example_agent_uses_its_tool_and_scores_the_answer():
    """examples/openai_agent.py's ReAct loop against a scripted model: call, result, answer."""
    import asyncio
    import runpy
    from pathlib import Path

    from openai import AsyncOpenAI

    from tests.serve.test_record import ScriptedEngine
    from turnrl.config import ServeConfig
    from turnrl.rollout import ChatFormat
    from turnrl.serve import Server
    from turnrl.serve.app import RunningServer

    example = runpy.run_path(str(Path(__file__).parents[2] / "examples" / "openai_agent.py"))
    task = example["task"](0)
    a, b = [int(w) for w in task["question"].rstrip("?").split() if w.isdigit()]
    call = f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
    model, tokenizer = tiny_model(seed=0)
    for replies, reward in (([call, f"It is {a * b}."], 1.0), ([f"It is {a * b + 1}."], 0.0)):
        server = Server(model, ChatFormat(tokenizer), ScriptedEngine(tokenizer, replies),
                        name="tiny", max_context=1024, cfg=ServeConfig(max_tokens=96))
        with RunningServer(server) as running:
            async def play():
                async with AsyncOpenAI(base_url=running.base_url, api_key="x") as client:
                    # one token a character: room for the call
                    return await example["rollout"](client, task, max_tokens=96)
            assert asyncio.run(play()) == reward


def test_a_stopped_run_resumes_from_its_last_checkpoint(tmp_path):
    """train_agent(resume=True) continues at the checkpoint's step with its weights served."""
    args = ["--model.name", "tiny", "--run.out_dir", str(tmp_path / "run"),
            "--rollout.group_size", "2", "--rollout.groups_per_step", "1", "--serve.port", "0",
            "--run.progress", "false", "--optim.lr", "1e-2", "--run.tensorboard", "false"]
    train_agent(rollout, ["Say a digit."], load_config(None, [*args, "--run.steps", "1"]))
    versions = set()

    async def watched(client, task):
        versions.add((await client.models.list()).data[0].policy_version)
        return await rollout(client, task)

    result = train_agent(watched, ["Say a digit."], load_config(None, [*args, "--run.steps", "2"]),
                         resume=True)
    assert len(result.rewards) == 1 and versions == {1}  # step 2 only, by step 1's weights
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]


def test_tree_rollouts_are_refused_for_agents_behind_the_endpoint():
    cfg = load_config(None, ["--rollout.branch.turns", "1", "--algo.advantage", "tree_grpo"])
    with pytest.raises(ConfigError, match="drop it for train_agent"):
        train_agent(None, ["Say a digit."], cfg)
