"""Seeded fuzz tests of TurnRL's HTTP boundaries, each against a real localhost peer that
misbehaves: the endpoint opponent and the MCP Streamable HTTP client against a socket server
that cuts its answers short, resets, sends garbage, huge bodies, redirects in a loop or stalls;
``turnrl serve`` against raw malformed requests (garbage and truncated bodies, wrong types,
huge bodies, slow clients, a client leaving mid-stream). Each failure must come out as the
documented one line (the source, the URL, the fix) or a 4xx JSON answer with the server still
serving; never a traceback, a hang or a silent drop."""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import pytest
from conftest import MovesEngine

from turnrl.envs import make_env
from turnrl.models import tiny_tokenizer
from turnrl.rollout import ChatFormat, SamplingParams, run_episodes, run_sync
from turnrl.selfplay import EndpointError, EndpointOpponent
from turnrl.tools.mcp import MCPHttpServer, MCPServerError

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
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
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


@pytest.mark.parametrize("seed", SEEDS)
def test_an_endpoint_opponent_fails_every_bad_answer_in_one_line_naming_it(seed):
    threads = threading.active_count()
    for case, (behave, phrase) in endpoint_cases(random.Random(seed)).items():
        with misbehaving(behave) as url:
            opponent = EndpointOpponent(url, "fuzz", timeout_s=1.0)
            started = time.monotonic()
            with pytest.raises(EndpointError) as caught:
                opponent.act("You play O.", "the board")
        message = str(caught.value)
        assert time.monotonic() - started < 15, case  # loose: the bound is 1 s
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
