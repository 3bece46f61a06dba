"""MCP servers' tools in a ToolEnv, against a real server subprocess (tests/helpers/mcp_server.py)
speaking JSON-RPC over stdio: listing, calls, tool errors, timeouts, a server that dies
mid-episode, one that never answers, one that cannot start."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from tests.rollout.test_rollout import ScriptedEngine
from turnrl import leftovers
from turnrl.envs import make_env
from turnrl.envs.tool_env import Task, ToolEnv
from turnrl.models import tiny_tokenizer
from turnrl.rewards import exact_match
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import SamplingParams
from turnrl.tools.mcp.client import input_schema
from turnrl.tools.mcp.errors import MCPServerError
from turnrl.tools.mcp.servers import close_shared_servers
from turnrl.tools.mcp.stdio import MCPServer

SERVER = [sys.executable, str(Path(__file__).parents[1] / "helpers" / "mcp_server.py")]


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def responses(observation: str) -> list[dict]:
    return [json.loads(line) for line in observation.splitlines() if line.startswith("{")]


@pytest.fixture
def server():
    server = MCPServer(SERVER, start_timeout_s=30)
    yield server
    server.close()


def env_with(server: MCPServer, timeout_s: float = 10.0) -> ToolEnv:
    return ToolEnv(lambda seed: Task("What is 2 plus 3?", "5"), server.tools(), exact_match,
                   call_timeout_s=timeout_s)


async def play(env: ToolEnv, replies: list[str]):
    await env.reset(0)
    return [await env.step(reply) for reply in replies]


async def timed_out_then_answered(env: ToolEnv) -> tuple:
    """A call that never answers under ``env``'s timeout, then one that answers under a loose
    timeout: it need only be answered (on a busy machine that can take over 0.5 s)."""
    await env.reset(0)
    slow = await env.step(call("sleep", seconds=30))
    env.call_timeout_s = 30.0
    return slow, await env.step(call("add", a=1, b=1))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_tools_are_listed_with_their_schemas_across_pages(server):
    tools = {t.name: t for t in server.tools()}
    assert list(tools) == ["add", "echo", "fail", "sleep", "crash", "count"]  # page 2 followed
    assert tools["add"].description == "Add two integers."
    assert tools["add"].schema()["function"]["parameters"] == {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}
    assert tools["fail"].parameters["properties"] == {}  # no properties given: none
    assert tools["echo"].parameters["properties"]["suffix"] == {"type": "string",
                                                                "nullable": True}
    assert server.server_info == {"name": "test", "version": "1"}
    env = env_with(server)
    assert '"name": "sleep"' in env.system_prompt and '"seconds"' in env.system_prompt


def test_a_call_result_is_the_observation_and_the_answer_is_rewarded(server):
    env = env_with(server)
    first, last = asyncio.run(play(env, [call("add", a=2, b=3), "The answer: 5"]))
    assert responses(first.observation) == [{"name": "add", "content": "5"}]
    assert not first.done and last.done and last.reward == 1.0 and last.info["success"]
    # the handshake came first: initialize, then the initialized notification
    (echo,) = asyncio.run(play(env, [call("echo", text="hi", suffix=None)]))
    content = responses(echo.observation)[0]["content"]
    assert content.startswith("hi initialize,notifications/initialized,tools/list,tools/list")


@pytest.mark.parametrize("reply, error", [
    (call("fail"), "fail raised MCPToolError: deliberate failure"),
    (call("add", a=2), "missing argument b"),
    (call("add", a="2", b=3), "argument 'a' must be an integer, got string"),
    (call("nope"), "unknown tool 'nope'"),
])
def test_tool_errors_and_bad_calls_are_error_observations(server, reply, error):
    env = env_with(server)
    (result,) = asyncio.run(play(env, [reply]))
    assert error in responses(result.observation)[0]["error"] and not result.done
    assert server.alive


def test_a_call_that_never_answers_times_out_and_the_server_goes_on(server):
    env = env_with(server, timeout_s=0.5)
    slow, fast = asyncio.run(timed_out_then_answered(env))
    assert responses(slow.observation)[0]["error"] == "sleep timed out after 0.5 s"
    assert responses(fast.observation) == [{"name": "add", "content": "2"}]


def test_calls_of_one_turn_run_concurrently(server):
    env = env_with(server)
    (result,) = asyncio.run(play(env, [call("sleep", seconds=1) + call("sleep", seconds=1)]))
    (a_start, a_end), (b_start, b_end) = (json.loads(r["content"])
                                          for r in responses(result.observation))
    assert a_start < b_end and b_start < a_end  # the two sleeps overlapped in the server


def test_a_server_that_dies_mid_episode_fails_the_episode_with_its_reason(server):
    chat = ChatFormat(tiny_tokenizer())
    engine = ScriptedEngine(chat.tokenizer, [call("crash")])
    (episode,) = run_sync(run_episodes(lambda: env_with(server), [(0, 0)], engine, chat,
                                       SamplingParams(max_new_tokens=64), max_turns=3))
    assert episode.status == "error" and episode.end_reason == "env_error"
    reason = episode.info["reason"]
    assert "MCPServerError" in reason and "exited with code 3" in reason
    assert "crashing on purpose" in reason
    # the next episode starts the server afresh
    first, _ = asyncio.run(play(env_with(server), [call("add", a=4, b=4), "8"]))
    assert responses(first.observation) == [{"name": "add", "content": "8"}]


def test_a_server_killed_between_turns_fails_the_next_turn(server):
    env = env_with(server)

    async def episode():
        await env.reset(0)
        await env.step(call("add", a=1, b=2))
        os.kill(server._proc.pid, 9)
        with pytest.raises(MCPServerError, match="exited with code -9"):
            await env.step(call("add", a=1, b=2))

    asyncio.run(episode())


@pytest.mark.parametrize("command, message", [
    (SERVER + ["--mode", "silent"], "no answer to initialize within 1 s; its stderr ends: "
                                    "test server ready"),
    (SERVER + ["--mode", "exit"], "exited with code 5; its stderr ends: cannot open the "
                                  "database"),
    (["turnrl-no-such-mcp-server", "--stdio"], "cannot run turnrl-no-such-mcp-server --stdio "
                                               "(No such file or directory)"),
    ([sys.executable, "-c", "print('hello, not JSON'); import time; time.sleep(60)"],
     "no answer to initialize within 1 s; its stderr ends: (not JSON on stdout)"),
])
def test_a_server_that_cannot_start_fails_with_the_reason_and_leaves_nothing(command, message):
    before = set(leftovers.child_processes())  # earlier tests of the suite may leave their own
    server = MCPServer(command, start_timeout_s=1)
    with pytest.raises(MCPServerError) as caught:
        server.start()
    assert message in str(caught.value) and "did not start" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert server._proc is None and not [p for p in leftovers.child_processes()
                                         if p not in before]




def test_the_mcp_env_from_options(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "What is 2 plus 3?", "answer": "5"}\n'
                     '{"prompt": "What is 4 plus 4?", "answer": "8"}\n')
    try:
        env = make_env("mcp", servers=[SERVER], tasks=str(tasks), max_turns=2)
        again = make_env("mcp", servers=[SERVER], tasks=str(tasks))
        assert env.servers == again.servers and len(env.servers) == 1  # one shared server
        pid = env.servers[0]._proc.pid

        async def episode():
            prompt = await env.reset(1)
            first = await env.step(call("add", a=4, b=4))
            return prompt, first, await env.step("\\boxed{8}")

        prompt, first, last = asyncio.run(episode())
        assert prompt == "What is 4 plus 4?" and responses(first.observation)[0]["content"] == "8"
        assert last.reward == 1.0
    finally:
        close_shared_servers()  # what `turnrl train` does at its end (leftovers.CLOSE_AT_END)
    assert not alive(pid)


@pytest.mark.parametrize("options, message", [
    ({"tasks": "x.jsonl"}, "give env.options.servers"),
    ({"servers": ["turnrl-no-such-mcp-server"], "tasks": "{tasks}"}, "cannot run"),
    ({"servers": [SERVER], "tasks": "missing.jsonl"}, "tasks file 'missing.jsonl' not found"),
    ({"servers": [SERVER], "tasks": "{tasks}", "reward": "fuzzy"}, "reward 'fuzzy' is unknown"),
    ({"servers": [SERVER], "tasks": "{tasks}", "per_episode": "yes"},
     "per_episode must be true or false, got 'yes'"),
])
def test_bad_mcp_env_options_fail_in_one_line(tmp_path, options, message):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"prompt": "p", "answer": "a"}\n')
    options = {k: (str(tasks) if v == "{tasks}" else v) for k, v in options.items()}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        make_env("mcp", **options)
    close_shared_servers()


def test_close_stops_the_server_process(server):
    server.start()
    pid = server._proc.pid
    assert alive(pid)
    server.close()
    assert not alive(pid)
    with pytest.raises(MCPServerError, match="not running"):
        server.check()


def test_input_schema_keeps_what_it_cannot_check_unchecked():
    schema = input_schema({"inputSchema": {"properties": {"x": {"type": ["integer", "string"]}},
                                           "required": ["x", "ghost"]}})
    assert schema == {"type": "object", "properties": {"x": {}}, "required": ["x"]}


def test_turnrl_train_with_an_mcp_env_ends_its_server_without_a_leftover_warning(tmp_path):
    import subprocess

    import yaml

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "What is 2 plus 3?", "answer": "5"}\n')
    config = tmp_path / "mcp.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"name": "tiny"},
        "env": {"name": "mcp", "options": {"servers": [SERVER + ["--only", "add"]],
                                           "tasks": str(tasks),
                                           "max_turns": 2}},
        "rollout": {"group_size": 2, "groups_per_step": 1, "max_new_tokens": 16},
        "run": {"steps": 1, "out_dir": str(tmp_path / "run"), "progress": False,
                "tensorboard": False},
        "eval": {"episodes": 0}}))
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "turnrl.cli", "train", "--config", str(config)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "child process" not in done.stderr, done.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_a_missing_server_command_is_one_error_line_at_start_up(tmp_path):
    import subprocess

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "p", "answer": "a"}\n')
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "turnrl.cli", "train", "--model.name", "tiny",
                           "--env.name", "mcp", "--env.options.servers",
                           "turnrl-no-such-mcp-server", "--env.options.tasks", str(tasks),
                           "--run.out_dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "cannot run turnrl-no-such-mcp-server (No such file or directory)" in lines[0]
