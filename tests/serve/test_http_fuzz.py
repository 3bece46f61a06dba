"""Seeded fuzz tests of TurnRL's HTTP boundaries, each against a real localhost peer that
misbehaves: the endpoint opponent and the MCP Streamable HTTP client against a socket server
that cuts its answers short, resets, sends garbage, huge bodies, redirects in a loop or stalls;
``turnrl serve`` against raw malformed requests (garbage and truncated bodies, wrong types,
huge bodies, slow clients, a client leaving mid-stream). Each failure must come out as the
documented one line (the source, the URL, the fix) or a 4xx JSON answer with the server still
serving; never a traceback, a hang or a silent drop."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import pytest
import torch

from tests.conftest import MovesEngine
from turnrl.envs import make_env
from turnrl.models import tiny_tokenizer
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import SamplingParams
from turnrl.selfplay.endpoint import EndpointError, EndpointOpponent
from turnrl.tools.mcp.errors import MCPServerError, MCPToolError
from turnrl.tools.mcp.http import MCPHttpServer

SEEDS = (0, 1, 2)


# ---- a misbehaving server --------------------------------------------------------------------

def read_request(conn: socket.socket) -> bytes:
    """One HTTP request's head and body (by its Content-Length), or what came before EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


Behave = Callable[[socket.socket, bytes, threading.Event], None]
"""What the server does with one connection, given the request it read and a stop event."""


@contextmanager
def misbehaving(behave: Behave):
    """A localhost server running ``behave`` on each connection (a thread each); its URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.05)  # accept() wakes up to see the stop event
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                behave(conn, read_request(conn), stop)
            except OSError:
                pass  # the client gave up on us: that is its business

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def answer(status: str, body: bytes, *, length: int | None = None,
           kind: str = "application/json", extra: str = "") -> bytes:
    length = len(body) if length is None else length
    return (f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {length}\r\n"
            f"{extra}Connection: close\r\n\r\n").encode() + body


def reset(conn: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0) instead of an orderly FIN."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def completion(content="[4]") -> bytes:
    return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant",
                                                            "content": content}}]}).encode()


def trickle(conn: socket.socket, stop: threading.Event) -> None:
    """A byte of a header every 50 ms, never finishing: each read is quick, the call is not."""
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    while not stop.wait(0.05):
        conn.sendall(b"X")


def stall(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{")
    stop.wait(30)


def endpoint_cases(rng: random.Random) -> dict[str, tuple[Behave, str]]:
    """Misbehaviours of a chat-completions endpoint, drawn from ``rng``, and the phrase the
    opponent's error must hold for each."""
    body = completion()
    cut = rng.randrange(0, len(body))
    junk = rng.randbytes(rng.randrange(1, 400))
    shape = rng.choice([b"[]", b"null", b'"move"', b'{"choices": []}', b'{"error": "busy"}',
                        b'{"choices": [{"message": {"content": 4}}]}', b"[" * 5000])
    return {
        "truncated": (lambda c, r, s: c.sendall(answer("200 OK", body[:cut], length=len(body))),
                      f"cut its reply short ({cut} bytes of the {len(body)}"),
        "reset": (lambda c, r, s: reset(c), "unreachable or cut off"),
        "reset mid-body": (lambda c, r, s: (c.sendall(answer("200 OK", body[:cut],
                                                             length=len(body))), reset(c)),
                           "check "),  # a reset or a short body: who sees it first
        "hang up": (lambda c, r, s: None, "unreachable or cut off (RemoteDisconnected"),
        "garbage status": (lambda c, r, s: c.sendall(b"\x00" + junk), "unreachable or cut off"),
        "garbage body": (lambda c, r, s: c.sendall(answer("200 OK", b"\xff" + junk)),
                         "a body that is not JSON"),
        "wrong shape": (lambda c, r, s: c.sendall(answer("200 OK", shape)),
                        "OpenAI-compatible"),
        "huge declared": (lambda c, r, s: c.sendall(answer("200 OK", b"{", length=1 << 40)),
                          "over the 8 MiB a reply may take"),
        "huge sent": (lambda c, r, s: c.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b" " * (9 << 20)),
                      "sent a reply over 8 MiB"),
        "error status": (lambda c, r, s: c.sendall(answer("503 Service Unavailable", junk)),
                         "answered HTTP 503 Service Unavailable"),
        "wrong key": (lambda c, r, s: c.sendall(answer("401 Unauthorized", b"")),
                      "set TURNRL_OPPONENT_API_KEY"),
        "redirect loop": (lambda c, r, s: c.sendall(answer(
            "307 Temporary Redirect", b"", extra="Location: /v1/chat/completions\r\n")),
                          "a redirect to '/v1/chat/completions'"),
        "stall": (lambda c, r, s: stall(c, s), "did not answer within 1s"),
        "trickle": (lambda c, r, s: trickle(c, s), "did not answer within 1s"),
    }


FIXES = ("check", "set ", "give ", "raise ")
TIMES_OUT = ("stall", "trickle")


def limit_s(case: str) -> float:
    """1 s for the cases whose phrase is that timeout; a loose one for the others (a 33 MiB
    answer read or a client built on a busy machine may take over 1 s, and would then time
    out instead of showing what the case tests); the elapsed bounds stay below it."""
    return 1.0 if case in TIMES_OUT else 30.0


@pytest.mark.parametrize("seed", SEEDS)
def test_an_endpoint_opponent_fails_every_bad_answer_in_one_line_naming_it(seed):
    threads = threading.active_count()
    for case, (behave, phrase) in endpoint_cases(random.Random(seed)).items():
        with misbehaving(behave) as url:
            opponent = EndpointOpponent(url, "fuzz", timeout_s=limit_s(case))
            started = time.monotonic()
            with pytest.raises(EndpointError) as caught:
                opponent.act("You play O.", "the board")
        message = str(caught.value)
        assert time.monotonic() - started < 15, case  # loose: below the 30 s limit
        assert message.startswith(f"opponent endpoint:fuzz at {url}/v1/chat/completions "), \
            (case, message)
        assert phrase in message and "\n" not in message, (case, message)
        assert any(fix in message for fix in FIXES), (case, message)
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads  # no call's timer or reader left behind


def test_a_good_answer_after_bad_ones_is_a_move_and_a_dead_url_is_named():
    with misbehaving(lambda c, r, s: c.sendall(answer("200 OK", completion("[7]")))) as url:
        assert EndpointOpponent(url, "ok", timeout_s=5).act(None, "board") == "[7]"
    with pytest.raises(EndpointError, match=r"^opponent endpoint:x at ftp://h/v1/chat/"
                                            r"completions unreachable or cut off .*check"):
        EndpointOpponent("ftp://h", "x").act(None, "board")


@pytest.mark.parametrize("role, raised", [("o", "env reset raised"), ("x", "env step raised")])
def test_a_truncated_answer_fails_the_game_with_the_opponent_and_url(role, raised):
    """The issue's case: a Content-Length larger than the body, at the game's reset (the
    endpoint moves first) or at a step; the game ends error with the one-line reason."""
    body = completion("5")
    with misbehaving(lambda c, r, s: c.sendall(answer("200 OK", body[:9], length=len(body)))
                     ) as url:
        opponent = EndpointOpponent(url, "cut", timeout_s=5)

        def make():
            env = make_env("tictactoe", opponent="endpoint", role=role)
            env.set_opponent(opponent)
            return env
        tok = tiny_tokenizer()
        chat = ChatFormat(tok)
        (episode,) = run_sync(run_episodes(
            make, [(0, 0)], MovesEngine(tok, ["5", "1"]), chat,
            SamplingParams(4, 1.0, stop_token_ids=(chat.end_of_turn,)), env_name="tictactoe"))
    assert episode.status == "error" and episode.end_reason == "env_error"
    reason = episode.info["reason"]
    assert reason.startswith(f"{raised} EndpointError: opponent endpoint:cut at {url}/v1/"), \
        reason
    assert f"cut its reply short (9 bytes of the {len(body)}" in reason
    assert "IncompleteRead" not in reason


# ---- the MCP Streamable HTTP client ----------------------------------------------------------

def rpc(result, id_=1) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": id_, "result": result}).encode()


def sse(*events: bytes) -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in events)


def mcp_cases(rng: random.Random) -> dict[str, tuple[Behave, str]]:
    """Misbehaviours of an MCP server answering ``initialize``, and the phrase for each."""
    good = rpc({"protocolVersion": "2025-06-18", "capabilities": {}})
    cut = rng.randrange(0, len(good))
    junk = rng.randbytes(rng.randrange(1, 400))
    shape = rng.choice([rpc([1, 2]), rpc("ok"), rpc(7), rpc({}, id_=[1]), rpc({}, id_={"a": 1}),
                        b"[" * 5000, b'{"jsonrpc": "2.0", "id": 1}x', b"[1, 2, 3]"])
    return {
        "truncated": (lambda c, r, s: c.sendall(answer("200 OK", good[:cut], length=len(good))),
                      "gave no answer to initialize (IncompleteRead"),
        "reset": (lambda c, r, s: reset(c), "gave no answer to initialize"),
        "hang up": (lambda c, r, s: None, "gave no answer to initialize"),
        "garbage status": (lambda c, r, s: c.sendall(b"\x00" + junk),
                           "gave no answer to initialize"),
        "garbage body": (lambda c, r, s: c.sendall(answer("200 OK", b"\xff" + junk)),
                         "answered initialize without its JSON-RPC answer"),
        "wrong shape": (lambda c, r, s: c.sendall(answer("200 OK", shape)), "answered"),
        "garbage stream": (lambda c, r, s: c.sendall(answer("200 OK", sse(junk.replace(
            b"\n", b" ")), kind="text/event-stream")), "ended the event stream of initialize"),
        "wrong type": (lambda c, r, s: c.sendall(answer("200 OK", good, kind="text/html")),
                       "Content-Type 'text/html'"),
        "huge declared": (lambda c, r, s: c.sendall(answer("200 OK", b"{", length=1 << 40)),
                          "(an answer over 32 MiB)"),
        "huge event": (lambda c, r, s: c.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
            + b"data: " + b"x" * (33 << 20)), "(an answer over 32 MiB)"),
        "error status": (lambda c, r, s: c.sendall(answer("500 Internal Server Error", junk)),
                         "answered initialize with HTTP 500 Internal Server Error"),
        "wrong key": (lambda c, r, s: c.sendall(answer("401 Unauthorized", b"")),
                      "check the headers given with the URL"),
        "redirect loop": (lambda c, r, s: c.sendall(answer(
            "307 Temporary Redirect", b"", kind="", extra="Location: /mcp\r\n")),
                          "answered initialize with HTTP 307"),
        "stall": (lambda c, r, s: stall(c, s), "no answer to initialize within 1 s"),
        "trickle": (lambda c, r, s: trickle(c, s), "no answer to initialize within 1 s"),
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_an_mcp_server_that_answers_badly_fails_its_start_in_one_line(seed):
    threads = threading.active_count()
    for case, (behave, phrase) in mcp_cases(random.Random(seed)).items():
        with misbehaving(behave) as base:
            url = f"{base}/mcp"
            client = MCPHttpServer(url, start_timeout_s=limit_s(case))
            started = time.monotonic()
            with pytest.raises(MCPServerError) as caught:
                client.start()
        message = str(caught.value)
        assert time.monotonic() - started < 15, case  # loose: below the 30 s limit
        assert message.startswith(f"MCP server '{base[7:]}' ({url}) did not start: "), \
            (case, message)
        assert phrase in message and "\n" not in message, (case, message)
        assert "check" in message, (case, message)
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads  # no POST's thread left blocked


def mcp_server_listing(tools_result: bytes, call_answer: Callable[[], bytes]) -> Behave:
    """An MCP server that starts well, lists ``tools_result`` and answers calls with
    ``call_answer()`` (raw HTTP)."""
    def behave(conn, request, stop):
        body = json.loads(request.partition(b"\r\n\r\n")[2] or b"{}")
        method, id_ = body.get("method"), body.get("id")
        if method == "initialize":
            conn.sendall(answer("200 OK", rpc({"protocolVersion": "2025-06-18"}, id_),
                                extra="Mcp-Session-Id: s1\r\n"))
        elif method == "tools/list":
            conn.sendall(tools_result.replace(b'"id": 0', f'"id": {id_}'.encode()))
        elif method == "tools/call":
            conn.sendall(call_answer().replace(b'"id": 0', f'"id": {id_}'.encode()))
        else:
            conn.sendall(answer("202 Accepted", b""))
    return behave


@pytest.mark.parametrize("seed", SEEDS)
def test_mcp_tool_listings_and_results_of_the_wrong_shape_are_taken_or_named(seed):
    """Garbage inside well-formed answers: a listing whose entries, schemas or results have
    the wrong types is taken as far as it makes sense (no schema: unchecked); a result that is
    not an object fails that call in one line; a call cut short fails it naming the server."""
    rng = random.Random(seed)
    odd = rng.choice([[1], "s", 3, None, {"a": 1}])
    tools = json.dumps({"jsonrpc": "2.0", "id": 0, "result": {"tools": [
        {"name": "t", "inputSchema": odd, "description": odd},
        {"name": "u", "inputSchema": {"properties": odd, "required": odd}},
        {"name": 5}, "junk"]}}).encode()
    results = iter([answer("200 OK", rpc({"content": odd}, 0)),
                    answer("200 OK", rpc({"content": [{"type": "resource", "resource": odd}]},
                                         0)),
                    answer("200 OK", rpc(rng.choice([[1], "s", 3]), 0)),
                    answer("200 OK", b'{"jsonrpc": "2.0", "id": 0, "res', length=90)])
    with misbehaving(mcp_server_listing(answer("200 OK", tools), lambda: next(results))
                     ) as base:
        client = MCPHttpServer(f"{base}/mcp", start_timeout_s=5)
        try:
            listed = {tool.name: tool for tool in client.tools()}
            assert sorted(listed) == ["t", "u"]
            for _ in range(2):  # content, a resource of the wrong type: text all the same
                assert isinstance(asyncio.run(client.call("t", {})), str)
            with pytest.raises(MCPToolError, match=r"answered tools/call with a result that "
                                                   r"is not an object \(\w+: .*\); check that "):
                asyncio.run(client.call("t", {}))
            with pytest.raises(MCPServerError, match=rf"^MCP server '{base[7:]}' gave no answer "
                                                     r"to tools/call \(IncompleteRead"):
                asyncio.run(client.call("t", {}))
        finally:
            client.close()


# ---- turnrl serve ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served():
    """``turnrl serve``'s app on the tiny model, with a 1 s body timeout and a 1 MiB body
    limit; the errors uvicorn logs (a traceback escaping a route is logged there)."""
    import logging

    from tests.serve.test_serve import tiny_server
    from turnrl.serve.app import RunningServer

    torch.set_num_threads(2)
    logged: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = logged.append
    for name in ("uvicorn.error", "uvicorn"):
        logging.getLogger(name).addHandler(handler)
    try:
        with RunningServer(tiny_server(body_timeout_s=1.0, max_body_mb=1.0, max_n=2)) as running:
            yield running.port, logged
    finally:
        for name in ("uvicorn.error", "uvicorn"):
            logging.getLogger(name).removeHandler(handler)


def send(port: int, raw: bytes, *, close_write: bool = False) -> tuple[int, bytes]:
    """Send ``raw`` on a new connection; (status, body) of the answer (0, b"" for none)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(raw)
        if close_write:
            conn.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 "):
        return 0, b""
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunk(body)
    return int(head.split()[1]), body


def dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, body = body.partition(b"\r\n")
        if not int(size, 16):
            break
        out, body = out + body[:int(size, 16)], body[int(size, 16) + 2:]
    return out


def post(path: str, body: bytes, length: int | None = None, extra: str = "") -> bytes:
    length = len(body) if length is None else length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}Connection: close\r\n\r\n").encode() + body


CHAT = "/v1/chat/completions"
GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "Say a digit."}],
        "max_tokens": 3}
VALUES = [None, 0, -1, 3, 1e308, -1e308, 10 ** 30, "", "x", "tiny", [], [1], ["a", 2], {},
          {"a": []}, True, False, [{"role": "user"}], {"type": "function"}]
FIELDS = ["model", "messages", "tools", "tool_choice", "n", "temperature", "top_p",
          "max_tokens", "stop", "logprobs", "top_logprobs", "stream", "stream_options",
          "turnrl_episode", "max_completion_tokens"]
MESSAGE_FIELDS = ["role", "content", "tool_calls", "name", "tool_call_id"]


def mutated(rng: random.Random) -> list[dict]:
    """Chat requests with one field (top level or the message's) of a random type: two
    values for each field."""
    bodies = []
    for field in FIELDS + MESSAGE_FIELDS:
        for value in rng.sample(VALUES, 2):
            body = json.loads(json.dumps(GOOD))
            (body if field in FIELDS else body["messages"][0])[field] = value
            bodies.append(body)
    return bodies


def assert_api_error(status: int, body: bytes, expected: tuple[int, ...], case) -> str:
    """The answer is OpenAI's error shape with one of ``expected`` and a one-line message."""
    assert status in expected, (case, status, body[:300])
    message = json.loads(body)["error"]["message"]
    assert message and "\n" not in message and "Traceback" not in message, (case, message)
    return message


def assert_serving(port: int, logged: list) -> None:
    """The server still answers a good request, and logged no error."""
    status, body = send(port, post(CHAT, json.dumps(GOOD).encode()))
    assert status == 200 and json.loads(body)["choices"], body[:300]
    assert not logged, [r.getMessage() for r in logged]


@pytest.mark.parametrize("seed", SEEDS)
def test_serve_answers_malformed_requests_with_a_4xx_json_error_and_goes_on(served, seed):
    port, logged = served
    rng = random.Random(seed)
    junk = rng.randbytes(rng.randrange(1, 300))
    cases = {
        "garbage": (post(CHAT, b"\x00" + junk), (400,), "not valid JSON"),
        "not UTF-8": (post(CHAT, b'{"model": "\xff"}'), (400,), "not valid JSON"),
        "too deep": (post(CHAT, b"[" * 100_000), (400,), "not valid JSON"),
        "not an object": (post(CHAT, json.dumps(rng.choice([[], 3, "x", None])).encode()),
                          (400,), "must be a JSON object"),
        "huge declared": (post(CHAT, b"{}", length=1 << 40), (413,), "serve.max_body_mb"),
        "huge sent": (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                      "Connection: close\r\n\r\n".encode()
                      + b"100000\r\n" + b" " * (1 << 20) + b"\r\n400\r\n" + b" " * 1024,
                      (413,), "serve.max_body_mb"),  # and no more: all it sent is read
        "reward garbage": (post("/v1/turnrl/episodes/e/reward", json.dumps(
            {"reward": rng.choice([10 ** 400, "nan", "inf", None, [1], "x"])}).encode()),
                           (400,), "a finite number"),
    }
    for case, (raw, expected, phrase) in cases.items():
        message = assert_api_error(*send(port, raw), expected, case)
        assert phrase in message, (case, message)
    for body in mutated(rng):  # wrong types: a 4xx naming the field, or a completion
        status, answer_ = send(port, post(CHAT, json.dumps(body).encode()))
        if status != 200:
            assert_api_error(status, answer_, (400, 404), body)
    assert_serving(port, logged)


def test_serve_survives_truncated_slow_and_departing_clients(served):
    port, logged = served
    body = json.dumps(GOOD).encode()
    # cut short: the client closes its side before the body it announced has come
    status, _ = send(port, post(CHAT, body[:10], length=len(body)), close_write=True)
    assert status in (0, 400)
    # slow: half a body, then nothing; meanwhile the server answers others; 408 at 1 s
    with socket.create_connection(("127.0.0.1", port), timeout=30) as slow:
        slow.sendall(post(CHAT, body[:10], length=len(body)))
        started = time.monotonic()
        assert_serving(port, logged)
        data = b""
        while chunk := slow.recv(65536):
            data += chunk
        assert time.monotonic() - started < 20  # loose: the bound is 1 s
    assert data.startswith(b"HTTP/1.1 408 "), data[:200]
    assert "serve.body_timeout_s" in json.loads(data.partition(b"\r\n\r\n")[2])["error"][
        "message"]
    # gone mid-stream: a streamed reply's client leaves after its first event
    streamed = json.dumps({**GOOD, "stream": True, "max_tokens": 12}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as leaving:
        leaving.sendall(post(CHAT, streamed))
        assert leaving.recv(65536).startswith(b"HTTP/1.1 200 ")
        reset(leaving)
    assert_serving(port, logged)


# ---- the judge's client ----------------------------------------------------------------------

def judge_cases(rng: random.Random) -> dict[str, tuple[Behave, str]]:
    """Misbehaviours of a judge's chat endpoint; the phrase its ``JudgeError`` holds ("" for
    an answer the judge reads as no scores)."""
    body = completion('{"scores": [1, 2]}')
    cut = rng.randrange(0, len(body))
    junk = rng.randbytes(rng.randrange(1, 300))
    return {
        "truncated": (lambda c, r, s: c.sendall(answer("200 OK", body[:cut], length=len(body))),
                      "failed (APIConnectionError"),
        "reset": (lambda c, r, s: reset(c), "failed (APIConnectionError"),
        "garbage body": (lambda c, r, s: c.sendall(answer("200 OK", b"\xff" + junk)), "failed ("),
        "error status": (lambda c, r, s: c.sendall(answer("500 Internal Server Error", junk)),
                         "failed (InternalServerError"),
        "stall": (lambda c, r, s: stall(c, s), "failed (APITimeoutError"),
        "wrong shape": (lambda c, r, s: c.sendall(answer("200 OK", rng.choice(
            [b"{}", b'{"choices": []}', b'{"choices": [{"message": {"content": 3}}]}']))), ""),
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_a_judge_endpoint_that_fails_raises_one_line_naming_it(seed):
    from turnrl.serve.agents import JudgeError, self_judge

    for case, (behave, phrase) in judge_cases(random.Random(seed)).items():
        with misbehaving(behave) as url:
            judge = self_judge(f"{url}/v1", "j", timeout_s=limit_s(case))
            started = time.monotonic()
            if not phrase:
                assert asyncio.run(judge("task", ["a", "b"])) is None, case
                continue
            with pytest.raises(JudgeError) as caught:
                asyncio.run(judge("task", ["a", "b"]))
        message = str(caught.value)
        assert time.monotonic() - started < 15, case  # loose: below the 30 s limit
        assert message.startswith(f"the judge 'j' at {url}/v1 {phrase}"), (case, message)
        assert "\n" not in message and "check that it is running" in message, (case, message)


def test_a_failing_judge_leaves_its_group_out_with_the_reason_and_the_step_goes_on():
    from tests.serve.test_record import ScriptedEngine
    from turnrl.config import ServeConfig
    from turnrl.serve import Server
    from turnrl.serve.agents import play_groups, self_judge
    from turnrl.serve.app import RunningServer

    tokenizer = tiny_tokenizer()
    server = Server(torch.nn.Linear(1, 1), ChatFormat(tokenizer), ScriptedEngine(tokenizer, ["hi"]),
                    name="tiny", max_context=1024, cfg=ServeConfig(max_tokens=8))

    async def rollout(client, task):  # no verifiable reward: the judge's to give
        await client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": task}])

    async def odd_judge(task, transcripts):
        return ["high"] * len(transcripts)

    with RunningServer(server) as running, \
            misbehaving(lambda c, r, s: reset(c)) as judge_url:
        for judge, why in ((self_judge(f"{judge_url}/v1", "j", timeout_s=5),
                            f"the judge raised JudgeError: the judge 'j' at {judge_url}/v1 "
                            "failed (APIConnectionError"),
                           (odd_judge, "the judge returned ['high', 'high'], not 2 finite")):
            episodes, left_out = asyncio.run(play_groups(server, running.base_url, rollout,
                                                         ["Q"], 2, 0, 1.0, judge))
            assert not episodes and len(left_out) == 2
            assert all(x["reason"].startswith(why) for x in left_out), left_out
            assert not server.recorder.episodes  # taken, none left behind
