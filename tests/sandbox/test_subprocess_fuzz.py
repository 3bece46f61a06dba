"""Subprocesses that misbehave at the boundary where their output enters TurnRL: MCP stdio
servers (``tests/helpers/mcp_bad_server.py``) and sandboxed code, as real processes.

Each writes random bytes, invalid UTF-8, a huge line, a truncated JSON-RPC message, exits
mid-message, closes its stdout but keeps running, never answers or floods its stderr, with
fixed seeds. The documented outcome and nothing else: for an MCP server, the tool's answer
(junk around it ignored), a tool-call observation (tool errors never raise), or one error
line naming the server, its command and what to do (the episode fails as env_error); for
the sandbox, a ``SandboxResult`` with its classified status. Never a traceback from a
thread, a hang or a silent drop; no process left.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from turnrl import leftovers
from turnrl.envs.tool_env import Task, ToolEnv
from turnrl.sandbox import STATUSES, Limits, Sandbox
from turnrl.sandbox.backends import bwrap_problem
from turnrl.tools.mcp.errors import MCPServerError
from turnrl.tools.mcp.stdio import MCPServer

BAD_SERVER = [sys.executable, str(Path(__file__).parents[1].joinpath("helpers", "mcp_bad_server.py"))]
RANDOM = ("random_bytes", "truncated", "exit_mid", "bad_result", "stderr_flood")
"""Misbehaviours that draw from the seed: run with two seeds; the rest with one."""

# what each misbehaviour becomes: the tool's answer, an observation, or a server error
DURING_CALL = {
    "random_bytes": ("answer", "poked"), "invalid_utf8": ("answer", "poked"),
    "not_object": ("answer", "poked"), "deep_json": ("answer", "poked"),
    "stderr_flood": ("answer", "poked"),
    "huge_line": ("server_error", "sent a message over 1048576 bytes"),
    "truncated": ("server_error", "exited with code 3"),
    "exit_mid": ("server_error", "exited with code 4"),
    "close_stdout": ("server_error", "closed its stdout"),
    "silent": ("observation", "poke timed out after 1 s"),
    "bad_result": ("observation", "answered tools/call with a result that is not an object"),
    "bad_id": ("observation", "poke timed out after 1 s"),
}
AT_START = {**DURING_CALL,
            "silent": ("server_error", "no answer to initialize within 1 s"),
            "bad_id": ("server_error", "no answer to initialize within 1 s"),
            "bad_result": ("server_error", "answered initialize with a result that is not an "
                                           "object")}
CASES = [(how, seed) for how in DURING_CALL for seed in ((0, 1) if how in RANDOM else (0,))]
TIMES_OUT = ("silent", "bad_id")
"""Misbehaviours that end in a timeout: 1 s then. The others get a loose limit (a server's
start, a Python process, can take over 1 s on a busy machine: they would time out instead of
showing what they test); a bound on the elapsed time below it tells that they did not wait."""
LOOSE_S = 30.0


def bad_server(how: str, when: str, seed: int) -> MCPServer:
    start_s = 1 if when == "initialize" and how in TIMES_OUT else LOOSE_S
    server = MCPServer([*BAD_SERVER, "--how", how, "--when", when, "--seed", str(seed)],
                       start_timeout_s=start_s)
    server.max_message_bytes = 1 << 20
    return server


def thread_errors():
    """Collect exceptions that escape any thread (a reader thread's traceback)."""
    caught, previous = [], threading.excepthook
    threading.excepthook = lambda args: caught.append(args.exc_value)
    return caught, previous


def assert_one_line_naming(message: str, server: MCPServer) -> None:
    assert "\n" not in message and "\r" not in message, message
    assert f"MCP server '{server.name}'" in message, message
    assert len(message) < 2000, message


@pytest.fixture
def no_leftovers():
    before = set(leftovers.child_processes())
    caught, previous = thread_errors()
    yield
    threading.excepthook = previous
    assert caught == [], caught
    deadline = time.monotonic() + 10
    while [p for p in leftovers.child_processes() if p not in before]:
        assert time.monotonic() < deadline, "a server process was left running"
        time.sleep(0.05)


@pytest.mark.parametrize("how, seed", CASES)
def test_a_server_misbehaving_at_start_fails_with_one_line(how, seed, no_leftovers):
    server = bad_server(how, "initialize", seed)
    kind, said = AT_START[how]
    started = time.monotonic()
    try:
        if kind == "answer":
            assert [t.name for t in server.tools()] == ["poke"]
            return
        with pytest.raises(MCPServerError) as caught:
            server.start()
        message = str(caught.value)
        assert_one_line_naming(message, server)
        assert said in message and "did not start" in message and "mcp_bad_server.py" in message
        assert "check that" in message  # what to do
        assert time.monotonic() - started < LOOSE_S - 10  # no wait for a loose limit
    finally:
        server.close()


async def one_call(server: MCPServer, call_timeout_s: float):
    env = ToolEnv(lambda seed: Task("Poke it.", "poked"), server.tools(),
                  lambda reply, answer: float(answer in reply), call_timeout_s=call_timeout_s)
    await env.reset(0)
    try:
        return await env.step('<tool_call>{"name": "poke", "arguments": {}}</tool_call>')
    finally:
        await env.close()


@pytest.mark.parametrize("how, seed", CASES)
def test_a_server_misbehaving_during_a_call_is_an_observation_or_a_named_failure(
        how, seed, no_leftovers):
    server = bad_server(how, "call", seed)
    kind, said = DURING_CALL[how]
    call_timeout_s = 1.0 if how in TIMES_OUT else LOOSE_S
    started = time.monotonic()
    try:
        if kind == "server_error":
            with pytest.raises(MCPServerError) as caught:
                asyncio.run(one_call(server, call_timeout_s))
            assert_one_line_naming(str(caught.value), server)
            assert said in str(caught.value)
        else:
            step = asyncio.run(one_call(server, call_timeout_s))
            [record] = step.info["tool_results"]
            key = "content" if kind == "answer" else "error"
            assert said in record.get(key, ""), record
        assert time.monotonic() - started < LOOSE_S - 10  # no wait for a loose limit
    finally:
        server.close()


# ---- the sandbox: whatever the code does with its output, a classified SandboxResult ------

SANDBOX_CASES = {
    "random_bytes": ("import os, random\nrandom.seed({seed})\n"
                     "os.write(1, random.randbytes(5000)); os.write(2, random.randbytes(3000))",
                     "ok"),
    "invalid_utf8": ("import os\nos.write(1, b'ok \\xff\\xfe\\n'); os.write(2, b'\\xc3(\\n')",
                     "ok"),
    "huge_output": ("import os\nwhile True: os.write(1, b'x' * 65536)", "output_limit"),
    "stderr_flood": ("import os, random\nrandom.seed({seed})\n"
                     "while True: os.write(2, random.randbytes(65536))", "output_limit"),
    "exit_mid_write": ("import os\nos.write(1, b'{{\"half\": ')\nos._exit(7)", "error"),
    "close_stdout_and_run": ("import os, time\nos.close(1); os.close(2)\ntime.sleep(60)",
                             "timeout"),
    "never_reads_stdin": ("import time\ntime.sleep(60)", "timeout"),
    "daemon_holds_pipes": ("import os, time\nif os.fork() == 0:\n    time.sleep(60)\n"
                           "print('parent done')", "ok"),
    "killed_mid_write": ("import os, signal\nos.write(1, b'partial')\n"
                         "os.kill(os.getpid(), signal.SIGKILL)", "error"),
}


SANDBOX_RUNS = [(case, seed) for case in sorted(SANDBOX_CASES)
                for seed in ((0, 1) if "{seed}" in SANDBOX_CASES[case][0] else (0,))]


@pytest.fixture(params=["bwrap", "fallback"])
def backend(request) -> str:
    if request.param == "bwrap" and bwrap_problem():
        pytest.skip(f"bwrap unusable here ({bwrap_problem()}); `make setup` installs it")
    return request.param


@pytest.mark.parametrize("case, seed", SANDBOX_RUNS)
def test_sandboxed_code_misbehaving_on_its_pipes_is_a_classified_result(backend, case, seed):
    code, status = SANDBOX_CASES[case]
    # 2 s where the case ends at the wall-clock limit; elsewhere a loose one (a Python
    # start on a busy machine can take seconds), which the elapsed bound below stays under
    limits = Limits(wall_s=2.0 if status == "timeout" else LOOSE_S, cpu_s=2.0,
                    output_bytes=20_000)
    sandbox = Sandbox(backend, limits)
    if case == "daemon_holds_pipes" and "cleanup" not in sandbox.guarantees:
        status = "error"  # the survivor is named ("outlived it and kept its output open")
    started = time.monotonic()
    result = sandbox.run_sync(textwrap.dedent(code.format(seed=seed)), stdin="x" * (1 << 20))
    assert result.status == status and result.status in STATUSES, result
    assert (result.reason == "") == (status == "ok") and "\n" not in result.reason
    assert len(result.stdout) + len(result.stderr) <= 2 * limits.output_bytes
    assert time.monotonic() - started < 20
    json.dumps(result.details)  # what a record keeps is JSON
    if case == "random_bytes":  # every byte kept, undecodable ones as U+FFFD
        rng = random.Random(seed)
        assert result.stdout == rng.randbytes(5000).decode(errors="replace")
        assert result.stderr == rng.randbytes(3000).decode(errors="replace")
    if case == "invalid_utf8":
        assert result.stdout == "ok \ufffd\ufffd\n" and result.stderr == "\ufffd(\n"
    if case == "exit_mid_write":
        assert result.stdout == '{"half": ' and result.reason == "exit code 7"
