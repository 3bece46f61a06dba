"""ToolEnv: a scripted tool user solves tool-arithmetic, malformed calls become observations,
a custom task with the sandboxed python tool, and two training steps on the tiny model."""

from __future__ import annotations

import asyncio
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from turnrl.config import load_config
from turnrl.envs import ENVS, make_env
from turnrl.envs.tool_env import Task, ToolEnv, calculator
from turnrl.metrics import read_metrics
from turnrl.rewards import code_tests_async, integer_match
from turnrl.sandbox import Limits, Sandbox
from turnrl.tools import python_tool
from turnrl.trainer import train


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


async def scripted_episode(env, seed: int, policy) -> list:
    """Play ``policy(observation) -> reply`` until the episode ends; return the StepResults."""
    observation, results = await env.reset(seed), []
    while True:
        result = await env.step(policy(observation))
        results.append(result)
        if result.done:
            return results
        observation = result.observation


def tool_user(observation: str) -> str:
    """Calls the calculator on the question, then answers with what it returned."""
    if question := re.search(r"What is (\d+) times (\d+)\?", observation):
        return call("calculator", expression=f"{question[1]} * {question[2]}")
    return json.loads(observation.split("\n")[1])["content"]


def test_tool_arithmetic_is_registered_and_solved_by_a_tool_user():
    assert "tool-arithmetic" in ENVS
    env = make_env("tool-arithmetic")
    assert "<tools>" in env.system_prompt and '"name": "calculator"' in env.system_prompt
    for seed in range(5):
        results = asyncio.run(scripted_episode(env, seed, tool_user))
        assert len(results) == 2 and results[-1].reward == 1.0
        info = results[-1].info
        assert info["success"] and info["well_formed_calls"] and info["tool_calls"] == 1


def test_tasks_are_three_digit_products_and_deterministic():
    env = make_env("tool-arithmetic")
    prompts = [asyncio.run(env.reset(seed)) for seed in (1, 0, 0)]
    assert prompts[0] != prompts[1] == prompts[2]
    a, b = map(int, re.findall(r"\d+", prompts[2]))
    assert 100 <= a <= 999 and 100 <= b <= 999 and env.task.answer == a * b


def test_a_guess_without_the_tool_fails():
    env = make_env("tool-arithmetic")
    results = asyncio.run(scripted_episode(env, 0, lambda obs: "123456"))
    assert results[-1].reward == 0.0 and not results[-1].info["success"]
    assert results[-1].info["tool_calls"] == 0 and not results[-1].info["well_formed_calls"]


@pytest.mark.parametrize("reply, error", [
    ("<tool_call>{calculator: 1+1}</tool_call>", "not valid JSON"),
    (call("calc", expression="1+1"), "unknown tool 'calc'; available: calculator"),
    (call("calculator"), "missing argument expression"),
    (call("calculator", expression=12), "argument 'expression' must be a string, got integer"),
    (call("calculator", expression="__import__('os')"), "calculator raised ValueError: only"),
])
def test_malformed_calls_give_error_observations_and_are_recorded(reply, error):
    env = make_env("tool-arithmetic")

    async def one_step():
        await env.reset(0)
        return await env.step(reply)

    result = asyncio.run(one_step())
    assert not result.done and result.reward == 0.0
    assert error in json.loads(result.observation.split("\n")[1])["error"]
    assert error in result.info["tool_results"][0]["error"]
    raised = "raised" in error  # a well-formed call whose tool failed is not malformed
    assert result.info["malformed_calls"] == (0 if raised else 1)
    assert result.info["well_formed_calls"] == raised


def test_bad_construction_fails_with_the_fix():
    with pytest.raises(ValueError, match="fmt 'xml' is unknown; use one of hermes"):
        ToolEnv(lambda seed: Task("q", 1), [calculator], integer_match, fmt="xml")
    with pytest.raises(TypeError, match="decorate the function with @tool"):
        ToolEnv(lambda seed: Task("q", 1), [len], integer_match)
    with pytest.raises(ValueError, match="bad env.options for 'tool-arithmetic'"):
        make_env("tool-arithmetic", digits=3)


def test_running_out_of_turns_ends_without_reward():
    env = make_env("tool-arithmetic", max_turns=2)
    results = asyncio.run(scripted_episode(env, 0, lambda obs: call("calculator",
                                                                    expression="1+1")))
    assert len(results) == 2 and results[-1].done and results[-1].reward == 0.0
    assert not results[-1].info["answered"] and results[-1].info["tool_calls"] == 2


def test_a_code_task_with_the_sandboxed_python_tool_and_an_async_reward():
    box = Sandbox("fallback", Limits(wall_s=2.0, cpu_s=1.0))
    tests = ["assert square(3) == 9", "assert square(-2) == 4"]

    async def reward(reply, answer, tests):
        return await code_tests_async(reply, tests, box)

    env = ToolEnv(lambda seed: Task("Write square(x).", None, {"tests": tests}),
                  [python_tool(box), calculator], reward, tool_bonus=0.1)
    replies = iter([call("python", code="print(7 ** 2)"),
                    "```python\ndef square(x):\n    return x * x\n```"])
    results = asyncio.run(scripted_episode(env, 0, lambda obs: next(replies)))
    assert '"content": "49\\n"' in results[0].observation
    assert results[-1].reward == pytest.approx(1.1)  # both tests, plus the tool bonus


def test_the_calculator_is_exact_and_bounded():
    assert asyncio.run(_calc("123 * 456")) == "56088"
    assert asyncio.run(_calc("(2 + 3) ** 2 / 5")) == "5"
    for bad in ["10 ** 10 ** 10", "((10**64)**64)**64"]:
        with pytest.raises(ValueError):
            asyncio.run(_calc(bad))


async def _calc(expression):
    return calculator.fn(expression)


def test_reward_is_the_last_integer():
    assert integer_match("The product is 56088.", 56088) == 1.0


def test_tool_arithmetic_trains_two_steps_on_the_tiny_model(tmp_path):
    cfg = load_config(None, ["--model.name", "tiny", "--env.name", "tool-arithmetic",
                             "--env.options.max_turns", "2", "--rollout.max_new_tokens", "24",
                             "--rollout.group_size", "2", "--rollout.groups_per_step", "2",
                             "--run.steps", "2", "--eval.episodes", "0",
                             "--run.progress", "false", "--run.tensorboard", "false",
                             "--run.out_dir", str(tmp_path)])
    train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]


EXAMPLE = Path(__file__).parents[2] / "examples" / "tool_task.py"


def test_the_example_task_is_solved_by_a_scripted_tool_user():
    env = runpy.run_path(str(EXAMPLE))["date_span"]()

    def policy(observation):
        if dates := re.findall(r"\d{4}-\d{2}-\d{2}", observation):
            return call("days_between", start=dates[0], end=dates[1])
        days = json.loads(observation.split("\n")[1])["content"]
        return f"The span is \\boxed{{{days}}}"

    results = asyncio.run(scripted_episode(env, 3, policy))
    assert results[-1].info["success"] and results[-1].reward == pytest.approx(1.15)


def test_the_example_trains_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, str(EXAMPLE), "--run.out_dir", str(tmp_path),
                          "--run.steps", "2", "--eval.episodes", "0", "--rollout.group_size",
                          "2", "--run.progress", "false"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "step-000002").is_dir()


def test_the_python_tool_runs_from_an_env_thread_as_the_turn_loop_calls_it():
    """The turn loop runs each env on its own thread and event loop (EnvRunner)."""
    from turnrl.rollout.env_calls import EnvRunner

    box = Sandbox("fallback", Limits(wall_s=2.0, cpu_s=1.0))
    env = ToolEnv(lambda seed: Task("Compute 2**20.", 2**20), [python_tool(box)],
                  lambda reply, answer: integer_match(reply, answer))
    runner = EnvRunner(env, "python-task")

    async def episode():
        await runner.call("reset", 0, 10.0)
        tool_turn = await runner.call("step", call("python", code="print(2**20)"), 10.0)
        return tool_turn, await runner.call("step", "1048576", 10.0)

    tool_turn, answer = asyncio.run(episode())
    assert '"content": "1048576\\n"' in tool_turn.observation
    assert answer.reward == 1.0 and answer.info["success"]
