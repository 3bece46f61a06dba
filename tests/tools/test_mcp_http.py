"""MCP tools over Streamable HTTP, against a real server subprocess (tests/helpers/mcp_http_server.py,
``http.server``) answering with JSON or with an event stream: listing, calls, sessions, tool
errors, timeouts, a server that dies, answers HTTP errors, hangs or is not there; and servers
per episode (stdio and HTTP), whose state does not leak from one episode to the next."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.rollout.test_rollout import ScriptedEngine
from tests.tools.test_mcp import SERVER, call, responses, timed_out_then_answered
from turnrl.envs import make_env
from turnrl.envs.tool_env import Task, ToolEnv
from turnrl.models import tiny_tokenizer
from turnrl.rewards import exact_match
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import SamplingParams
from turnrl.tools.mcp.errors import MCPServerError
from turnrl.tools.mcp.http import MCPHttpServer, sse_data
from turnrl.tools.mcp.servers import close_shared_servers

HTTP_SERVER = [sys.executable, str(Path(__file__).parents[1] / "helpers" / "mcp_http_server.py")]


def start_http_server(*args: str) -> tuple[subprocess.Popen, str]:
    """The test server in a subprocess, and its URL once it listens."""
    proc = subprocess.Popen(HTTP_SERVER + list(args), stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("port "):
        proc.kill()
        raise RuntimeError(f"the test MCP HTTP server did not start: {line!r}")
    return proc, f"http://127.0.0.1:{int(line.split()[1])}/mcp"


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdout.close()


@pytest.fixture(params=["json", "sse"])
def served(request):
    """(process, URL) of a test server answering in JSON or as an event stream."""
    proc, url = start_http_server("--answer", request.param)
    yield proc, url
    stop(proc)


@pytest.fixture
def server(served):
    client = MCPHttpServer(served[1], start_timeout_s=30, headers={"X-Tenant": "team-7"})
    yield client
    client.close()


def env_with(server, timeout_s: float = 10.0) -> ToolEnv:
    return ToolEnv(lambda seed: Task("What is 2 plus 3?", "5"), server.tools(), exact_match,
                   call_timeout_s=timeout_s)


async def play(env: ToolEnv, replies: list[str]):
    await env.reset(0)
    return [await env.step(reply) for reply in replies]


def episodes_of(make_env_fn, replies: list[str], count: int = 1):
    chat = ChatFormat(tiny_tokenizer())
    engine = ScriptedEngine(chat.tokenizer, replies)
    return run_sync(run_episodes(make_env_fn, [(s, s) for s in range(count)], engine, chat,
                                 SamplingParams(max_new_tokens=64), max_turns=3))


def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_tools_are_listed_and_called_in_one_session(server, served):
    tools = {t.name: t for t in server.tools()}
    assert list(tools) == ["add", "echo", "fail", "sleep", "crash", "count", "break"]
    assert tools["add"].parameters["required"] == ["a", "b"]
    assert server.server_info == {"name": "http-test", "version": "1"}
    env = env_with(server)
    first, last = asyncio.run(play(env, [call("add", a=2, b=3), "The answer: 5"]))
    assert responses(first.observation) == [{"name": "add", "content": "5"}]
    assert last.done and last.reward == 1.0
    (echo,) = asyncio.run(play(env, [call("echo", text="hi")]))
    text, seen, tenant = responses(echo.observation)[0]["content"].split(" ")
    assert text == "hi" and tenant == "team-7"  # the configured header went along
    # One session from the handshake on; each later message carried the negotiated version.
    methods = [m for m in seen.split(",") if not m.startswith("answer:")]
    assert methods[:4] == ["initialize", "notifications/initialized", "tools/list",
                           "tools/call"]
    pings = [m for m in seen.split(",") if m.startswith("answer:")]
    if "sse" in served[1] or pings:  # the event stream's ping requests were answered
        assert pings and all(p.startswith("answer:ping-") for p in pings)
        assert pings[-1].endswith(":2025-06-18")


@pytest.mark.parametrize("reply, error", [
    (call("fail"), "fail raised MCPToolError: deliberate failure"),
    (call("add", a="2", b=3), "argument 'a' must be an integer, got string"),
])
def test_tool_errors_are_error_observations(server, reply, error):
    (result,) = asyncio.run(play(env_with(server), [reply]))
    assert error in responses(result.observation)[0]["error"] and not result.done
    assert server.alive


def test_a_json_rpc_error_answer_is_an_error_observation(server):
    env = env_with(server)
    server._listed.append({"name": "ghost"})  # a tool the server does not have
    env = ToolEnv(env.tasks, server.tools(), exact_match)
    (result,) = asyncio.run(play(env, [call("ghost")]))
    assert "Unknown tool: ghost (JSON-RPC error -32602)" in responses(result.observation)[0][
        "error"]
    assert server.alive


def test_a_call_that_never_answers_times_out_and_the_server_goes_on(server):
    env = env_with(server, timeout_s=0.5)
    threads = threading.active_count()
    slow, fast = asyncio.run(timed_out_then_answered(env))
    assert responses(slow.observation)[0]["error"] == "sleep timed out after 0.5 s"
    assert responses(fast.observation) == [{"name": "add", "content": "2"}]
    # the abandoned POST's thread was unblocked, not left waiting for the sleep
    deadline = time.monotonic() + 20
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.1)
    assert threading.active_count() <= threads


def test_a_cancellation_a_busy_server_cannot_take_does_not_break_it():
    """A server serving one request at a time is still busy with the call that timed out
    when its cancellation arrives; the cancellation is best effort, the server goes on."""
    proc, url = start_http_server("--single")
    client = MCPHttpServer(url, start_timeout_s=30)
    try:
        env = env_with(client, timeout_s=0.5)

        async def episode():
            await env.reset(0)
            slow = await env.step(call("sleep", seconds=2))
            await asyncio.sleep(3)  # the server is free again (its cancellation long given up)
            env.call_timeout_s = 30.0  # this call need only be answered (a busy machine)
            return slow, await env.step(call("add", a=1, b=1))

        slow, fast = asyncio.run(episode())
        assert responses(slow.observation)[0]["error"] == "sleep timed out after 0.5 s"
        assert responses(fast.observation) == [{"name": "add", "content": "2"}]
        assert client.alive
    finally:
        client.close()
        stop(proc)


def test_calls_of_one_turn_run_concurrently(server):
    (result,) = asyncio.run(play(env_with(server), [call("sleep", seconds=1) * 2]))
    (a_start, a_end), (b_start, b_end) = (json.loads(r["content"])
                                          for r in responses(result.observation))
    assert a_start < b_end and b_start < a_end


def test_a_server_that_dies_mid_episode_fails_the_episode_then_the_next_start(server, served):
    proc, url = served
    env = env_with(server)
    (episode,) = episodes_of(lambda: env, [call("crash")])
    assert episode.status == "error" and episode.end_reason == "env_error"
    reason = episode.info["reason"]
    assert "MCPServerError" in reason and "gave no answer to tools/call" in reason, reason
    proc.wait(timeout=30)
    # The server is gone: the next episode fails at its reset, saying so (not a hang).
    (next_one,) = episodes_of(lambda: env, ["5"])
    assert next_one.end_reason == "env_error"
    assert (f"({url}) did not start: cannot be reached (Connection refused)"
            in next_one.info["reason"]), next_one.info["reason"]


def test_an_http_error_fails_the_episode_and_the_next_one_opens_a_new_session(server):
    before = server.start()._session
    (episode,) = episodes_of(lambda: env_with(server), [call("break")])
    assert episode.end_reason == "env_error"
    assert ("answered tools/call with HTTP 500 Internal Server Error: internal error: the "
            "database is locked") in episode.info["reason"]
    first, _ = asyncio.run(play(env_with(server), [call("add", a=4, b=4), "8"]))
    assert responses(first.observation) == [{"name": "add", "content": "8"}]
    assert server._session not in (None, before)


def test_a_session_the_server_ended_fails_the_episode_with_that_reason(server, served):
    env = env_with(server)

    async def episode():
        await env.reset(0)
        await env.step(call("add", a=1, b=2))
        end_session(served[1], server._session)  # the server forgets it (as on a restart)
        with pytest.raises(MCPServerError, match=r"no longer knows session \w+ \(HTTP 404"):
            await env.step(call("add", a=1, b=2))

    asyncio.run(episode())


def end_session(url: str, session: str) -> None:
    host, port = url.split("/")[2].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("DELETE", "/mcp", headers={"Mcp-Session-Id": session})
    assert connection.getresponse().status == 200
    connection.close()


def test_a_server_that_hangs_fails_its_start_in_bounded_time():
    proc, url = start_http_server("--mode", "silent")
    try:
        threads = threading.active_count()
        client = MCPHttpServer(url, start_timeout_s=1)
        started = time.monotonic()
        with pytest.raises(MCPServerError) as caught:
            client.start()
        assert time.monotonic() - started < 20  # loose: the bound is 1 s
        assert str(caught.value) == (f"MCP server '{url.split('/')[2]}' ({url}) did not start: "
                                     "no answer to initialize within 1 s; check that the server "
                                     "answers MCP, or raise the env's start_timeout_s")
        deadline = time.monotonic() + 20
        while threading.active_count() > threads and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threading.active_count() <= threads  # its POST's thread did not stay blocked
    finally:
        stop(proc)


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:{closed}/mcp", "did not start: cannot be reached (Connection refused); "
                                      "check the URL and that the server is running"),
    ("http://nonexistent.invalid/mcp", "did not start: cannot be reached (host not found:"),
    ("ftp://127.0.0.1/mcp", "is not an http:// or https:// URL; give it as "
                            "http://HOST:PORT/PATH"),
    ("http:///mcp", "is not an http:// or https:// URL"),
    ("http://127.0.0.1:port/mcp", "has a bad port"),
    ({"url": "http://127.0.0.1:1/mcp", "command": "python s.py"}, "give either command"),
    ({"url": "http://127.0.0.1:1/mcp", "headers": ["Authorization"]}, "headers a mapping"),
    ({"command": "python s.py", "headers": {"A": "b"}}, "headers go with a url"),
    ({"uri": "http://127.0.0.1:1/mcp"}, "not uri"),
    (3, "is not a command, a URL or a mapping"),
])
def test_a_bad_server_url_or_spec_is_one_line_from_the_env(tmp_path, url, message):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"prompt": "p", "answer": "a"}\n')
    if isinstance(url, str):
        url = url.replace("{closed}", str(closed_port()))
    started = time.monotonic()
    try:
        with pytest.raises(ValueError) as caught:
            make_env("mcp", servers=[url], tasks=str(tasks), start_timeout_s=5)
    finally:
        close_shared_servers()
    assert message in str(caught.value) and str(caught.value).startswith("mcp env: ")
    assert "\n" not in str(caught.value) and time.monotonic() - started < 30


def test_the_mcp_env_from_a_url_with_headers(tmp_path, served):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "What is 4 plus 4?", "answer": "8"}\n')
    try:
        env = make_env("mcp", servers=[{"url": served[1], "headers": {"X-Tenant": "blue"}}],
                       tasks=str(tasks))
        again = make_env("mcp", servers=[{"url": served[1], "headers": {"X-Tenant": "blue"}}],
                         tasks=str(tasks))
        assert env.servers == again.servers  # one shared session
        first, last = asyncio.run(play(env, [call("echo", text="x"), "\\boxed{8}"]))
        assert responses(first.observation)[0]["content"].endswith(" blue")
        assert last.reward == 1.0
    finally:
        close_shared_servers()


def test_the_event_stream_parser():
    lines = [b": comment\n", b"event: other\n", b"data: skipped\n", b"\n",
             b"id: 7\r\n", b"data: {\"a\":\r\n", b"data:1}\r\n", b"\r\n", b"data: last"]
    assert list(sse_data(lines)) == ['{"a":\n1}', "last"]


# ---- a server per episode -------------------------------------------------------------------


def count_episodes(make, count: int = 3):
    return episodes_of(make, [call("count"), "done"], count)


def first_count(episode) -> str:
    return responses(episode.turns[0].observation)[0]["content"]


def test_a_shared_stdio_server_leaks_state_between_episodes_and_per_episode_does_not(tmp_path):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"prompt": "Count.", "answer": "done"}\n')
    try:
        shared = count_episodes(lambda: make_env("mcp", servers=[SERVER], tasks=str(tasks)))
        assert sorted(first_count(e) for e in shared) == ["1", "2", "3"]  # the leak
        pids = []

        def fresh():
            env = make_env("mcp", servers=[SERVER], tasks=str(tasks), per_episode=True)
            pids.append(env.servers[0])
            return env

        own = count_episodes(fresh)
        assert [first_count(e) for e in own] == ["1", "1", "1"]
        assert all(e.status == "done" for e in own)
        processes = {s._proc.pid if s._proc else None for s in pids}
        assert processes == {None}  # each episode's server was closed at its end
    finally:
        close_shared_servers()


def test_a_per_episode_server_is_stopped_when_its_episode_ends_any_way(tmp_path):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"prompt": "Count.", "answer": "done"}\n')
    try:
        envs = []

        def fresh():
            env = make_env("mcp", servers=[SERVER], tasks=str(tasks), per_episode=True)
            envs.append(env)
            return env

        # answered (the env says done); out of the turn loop's turns (the env is not told:
        # its server goes when the env is dropped); the server crashing
        endings = [episodes_of(fresh, replies)[0].end_reason
                   for replies in ([call("count"), "done"], [call("count")], [call("crash")])]
        assert endings == ["done", "turn_limit", "env_error"]
        started = [s for env in envs for s in env.servers if s.server_info]
        assert len(started) == 3
        del envs[:]  # what the turn loop does with an ended episode's env
        deadline = time.monotonic() + 20
        while any(s._proc is not None for s in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(s._proc is None for s in started)
    finally:
        close_shared_servers()


def test_per_episode_http_sessions_keep_state_apart(tmp_path, served):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"prompt": "Count.", "answer": "done"}\n')
    try:
        shared = count_episodes(lambda: make_env("mcp", servers=[served[1]], tasks=str(tasks)))
        own = count_episodes(lambda: make_env("mcp", servers=[served[1]], tasks=str(tasks),
                                              per_episode=True))
        assert sorted(first_count(e) for e in shared) == ["1", "2", "3"]
        assert [first_count(e) for e in own] == ["1", "1", "1"]
    finally:
        close_shared_servers()


def test_turnrl_train_with_servers_per_episode_leaves_no_process(tmp_path):
    import yaml

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "What is 2 plus 3?", "answer": "5"}\n')
    config = tmp_path / "mcp.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"name": "tiny"},
        "env": {"name": "mcp", "options": {"servers": [SERVER + ["--only", "add"]],
                                           "tasks": str(tasks), "max_turns": 2,
                                           "per_episode": True}},
        "rollout": {"group_size": 2, "groups_per_step": 1, "max_new_tokens": 16},
        "run": {"steps": 2, "out_dir": str(tmp_path / "run"), "progress": False,
                "tensorboard": False},
        "eval": {"episodes": 0}}))
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "turnrl.cli", "train", "--config", str(config)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "child process" not in done.stderr, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len([r for r in rows if "step" in r]) >= 2

