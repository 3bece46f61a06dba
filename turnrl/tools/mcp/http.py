"""MCP over Streamable HTTP (``MCPHttpServer``): each JSON-RPC message is POSTed to the
server's URL, a request's answer comes back as a JSON body or in a ``text/event-stream``, and
the session id from the answer to ``initialize`` goes with every later message
(the package docstring says how the client behaves; ``client.py`` is the shared half)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse
from typing import Any

from turnrl.tools.mcp.client import (
    PROTOCOL_VERSION,
    MCPClient,
)

MAX_MESSAGE_BYTES = 32 << 20
"""The most one answer (a JSON body, or one event of a stream) may take: 32 MiB, far above a
tool's result, so a server sending without end cannot fill memory."""
PROTOCOL_FIX = "check that the URL serves MCP over Streamable HTTP"


class TooLarge(http.client.HTTPException):
    """An answer over ``MAX_MESSAGE_BYTES``: the exchange fails as a broken connection does."""

    def __str__(self) -> str:
        return f"an answer over {MAX_MESSAGE_BYTES >> 20} MiB"


class _Exchange:
    """One POST in flight: its connection, and whether the client gave up on it."""

    def __init__(self, connection: http.client.HTTPConnection):
        self.connection, self.abandoned, self.connected = connection, False, False

    def abort(self) -> None:
        """Unblock the thread reading the answer (from any thread): shut the socket down."""
        self.abandoned = True
        sock = self.connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class MCPHttpServer(MCPClient):
    """One MCP server over Streamable HTTP, at ``url``: each JSON-RPC message is a POST there;
    a request's answer comes back as ``application/json`` or as a ``text/event-stream`` (SSE)
    whose events carry it (and maybe the server's notifications and requests first). The
    session id the server gives in its answer to ``initialize`` (``Mcp-Session-Id``) goes
    with every later message; ``close()`` ends the session (DELETE).

    Each request is a POST on a thread of its own, so calls overlap; a wait that gives up
    (a timeout) shuts the POST's socket down, so no thread outlives its caller's bound.
    A server that cannot be reached, answers an HTTP error or an unreadable body, or ends
    a stream without the answer is gone: pending calls fail with ``MCPServerError``, and the
    next ``start()`` opens a new session. Standard library only (``http.client``)."""

    def __init__(self, url: str, *, name: str = "", headers: dict | None = None,
                 start_timeout_s: float = 30.0):
        super().__init__()
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"MCP server URL '{url}' is not an http:// or https:// URL; "
                             "give it as http://HOST:PORT/PATH")
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError:
            raise ValueError(f"MCP server URL '{url}' has a bad port; give it as "
                             "http://HOST:PORT/PATH") from None
        self.url, self.name = url, name or parts.netloc
        self.headers = {str(k): str(v) for k, v in (headers or {}).items()}
        self.start_timeout_s = start_timeout_s
        self._parts = parts
        self._session: str | None = None
        self._protocol = ""
        self._open_flag = False
        self._exchanges: dict[int, _Exchange] = {}  # JSON-RPC id -> its POST
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return self.url

    @property
    def alive(self) -> bool:
        return self._open_flag and not self._death

    def _open(self) -> None:
        self._death, self._session, self._protocol = "", None, ""
        self._pending.drop()
        self._open_flag = True

    def _initialized(self, result: dict) -> None:
        super()._initialized(result)
        self._protocol = str(result.get("protocolVersion") or PROTOCOL_VERSION)

    def close(self) -> None:
        """End the session (DELETE, best effort) and fail pending calls."""
        was_open, self._open_flag = self._open_flag, False
        with self._lock:
            exchanges, self._exchanges = list(self._exchanges.values()), {}
        for exchange in exchanges:
            exchange.abort()
        if was_open and self._session and not self._death:
            try:
                exchange = _Exchange(self._connection(2.0))
                with self._http("DELETE", None, exchange):
                    exchange.connection.close()
            except (OSError, http.client.HTTPException, ValueError):
                pass
        self._session = None
        self._pending.fail_all(f"MCP server '{self.name}' was closed")

    # --- HTTP ------------------------------------------------------------------------------

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json",
                   "Accept": "application/json, text/event-stream", **self.headers}
        if self._session:
            headers["Mcp-Session-Id"] = self._session
        if self._protocol:
            headers["MCP-Protocol-Version"] = self._protocol
        return headers

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        kind = (http.client.HTTPSConnection if self._parts.scheme == "https"
                else http.client.HTTPConnection)
        return kind(self._parts.hostname, self._parts.port, timeout=timeout_s)

    def _http(self, method: str, body: bytes | None, exchange: _Exchange,
              unbounded: bool = False) -> http.client.HTTPResponse:
        """Send one HTTP request on ``exchange``; the response (its body unread). The
        connection's timeout bounds each wait, except with ``unbounded`` (a request): then it
        bounds the connect alone, and the request's waiter bounds the answer (a tool call
        may take its whole ``call_timeout_s``) and aborts the exchange when it gives up."""
        connection = exchange.connection
        connection.connect()
        exchange.connected = True
        if unbounded:
            connection.sock.settimeout(None)
        if exchange.abandoned:  # given up on while connecting
            raise ConnectionAbortedError("abandoned")
        path = self._parts.path or "/"
        if self._parts.query:
            path += "?" + self._parts.query
        connection.request(method, path, body=body, headers=self._headers())
        return connection.getresponse()

    def _send(self, message: dict) -> None:
        """POST a message. A request's POST runs on its own thread (its answer resolves its
        future); a notification or an answer to the server waits for the server's 202."""
        if not self.alive:
            self.check()
        body = json.dumps(message, ensure_ascii=False).encode()
        request_id = message.get("id") if "method" in message else None
        if request_id is None:
            self._post_one_way(message, body)
            return
        exchange = _Exchange(self._connection(self.start_timeout_s))
        with self._lock:
            self._exchanges[request_id] = exchange
        threading.Thread(target=self._exchange, args=(request_id, message["method"], body,
                                                      exchange),
                         daemon=True, name=f"mcp-{self.name}-{request_id}").start()

    def _post_one_way(self, message: dict, body: bytes, best_effort: bool = False) -> None:
        """POST a message that gets no JSON-RPC answer; a failure breaks the server, unless
        ``best_effort`` (a cancellation: a server busy with the very call it cancels may not
        take it in time, and need not)."""
        exchange = _Exchange(self._connection(self.start_timeout_s))
        try:
            with self._http("POST", body, exchange) as response:
                text = response.read(2000)
        except (OSError, http.client.HTTPException, ValueError) as err:
            if not best_effort:
                self._broken(_lost(err, message.get("method") or "an answer", exchange))
                self.check()
            return
        finally:
            exchange.connection.close()
        if response.status >= 400 and not best_effort:
            what = message.get("method") or "an answer"
            self._broken(f"answered {what} with HTTP {response.status} {response.reason}"
                         f"{_body_text(text)}")
            self.check()

    def _exchange(self, request_id: int, method: str, body: bytes, exchange: _Exchange) -> None:
        """The thread of one request: POST it, read the answer (JSON or an event stream)."""
        try:
            with self._http("POST", body, exchange, unbounded=True) as response:
                failure = self._answer(request_id, method, response)
        except (OSError, http.client.HTTPException, ValueError) as err:
            failure = "" if self._pending.answered(request_id) else _lost(err, method, exchange)
        finally:
            exchange.connection.close()
            with self._lock:
                self._exchanges.pop(request_id, None)
        if failure and not exchange.abandoned:
            self._broken(failure)

    def _answer(self, request_id: int, method: str,
                response: http.client.HTTPResponse) -> str:
        """Route what ``response`` carries; a reason when the server failed, else ''."""
        kind = (response.getheader("Content-Type") or "").split(";")[0].strip().lower()
        if response.status >= 400:
            text = response.read(4000)
            if kind == "application/json" and self._route(text, request_id):
                return ""  # a JSON-RPC error answer, sent with an HTTP error status
            if response.status == 404 and self._session:
                return (f"no longer knows session {self._session} (HTTP 404 to {method}): it "
                        "restarted or ended the session")
            return (f"answered {method} with HTTP {response.status} {response.reason}"
                    f"{_body_text(text)}; {_status_fix(response.status)}")
        if method == "initialize":
            self._session = response.getheader("Mcp-Session-Id") or None
        if kind == "text/event-stream":
            for data in sse_data(bounded_lines(response)):
                if self._route(data.encode(), request_id):
                    return ""  # our answer came: stop reading (the server may keep it open)
            return f"ended the event stream of {method} without its answer; {PROTOCOL_FIX}"
        if kind == "application/json":
            if self._route(bounded_read(response), request_id):
                return ""
            return f"answered {method} without its JSON-RPC answer; {PROTOCOL_FIX}"
        return (f"answered {method} with HTTP {response.status} and Content-Type "
                f"'{kind or 'none'}' (expected application/json or text/event-stream); "
                f"{PROTOCOL_FIX}")

    def _route(self, raw: bytes, request_id: int) -> bool:
        """Dispatch the JSON-RPC message(s) in ``raw``; True once ``request_id`` is answered."""
        try:
            parsed = json.loads(raw)
        except ValueError:
            return False
        answered = False
        for message in parsed if isinstance(parsed, list) else [parsed]:
            if isinstance(message, dict):
                answered |= "method" not in message and message.get("id") == request_id
                self._dispatch(message)
        return answered

    def _broken(self, reason: str) -> None:
        """The server is gone (for now): fail every pending call with ``reason``."""
        if self._death or not self._open_flag:
            return
        self._death = f"MCP server '{self.name}' {reason}"
        with self._lock:
            exchanges, self._exchanges = list(self._exchanges.values()), {}
        for exchange in exchanges:
            exchange.abort()
        self._pending.fail_all(self._death)

    def _abandoned(self, request_id: int) -> None:
        with self._lock:
            exchange = self._exchanges.pop(request_id, None)
        if exchange is not None:
            exchange.abort()
        if self.alive:  # a POST of its own: not on the caller's event loop
            threading.Thread(target=self._cancel_quietly, args=(request_id,), daemon=True,
                             name=f"mcp-{self.name}-cancel").start()

    def _cancel_quietly(self, request_id: int) -> None:
        message = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                   "params": {"requestId": request_id, "reason": "timed out"}}
        if self.alive:
            self._post_one_way(message, json.dumps(message).encode(), best_effort=True)


def sse_data(lines) -> Any:
    """The ``data`` of each event of a ``text/event-stream`` (lines of bytes): consecutive
    ``data:`` lines joined by newlines, sent at a blank line; comments (``:``), ``id``,
    ``retry`` and events named other than ``message`` are skipped."""
    data, event = [], "message"
    for raw in lines:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data and event == "message":
                yield "\n".join(data)
            data, event = [], "message"
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value or "message"
    if data and event == "message":
        yield "\n".join(data)


def bounded_read(response: http.client.HTTPResponse) -> bytes:
    """A JSON answer's body; ``TooLarge`` past ``MAX_MESSAGE_BYTES``, ``IncompleteRead`` when
    it ends before its ``Content-Length``."""
    if (response.length or 0) > MAX_MESSAGE_BYTES:
        raise TooLarge
    raw = response.read(MAX_MESSAGE_BYTES + 1)
    if len(raw) > MAX_MESSAGE_BYTES:
        raise TooLarge
    if response.length:  # read(n) returns a short body without saying so
        raise http.client.IncompleteRead(raw, response.length)
    return raw


def bounded_lines(response: http.client.HTTPResponse):
    """The lines of an event stream; ``TooLarge`` once one event (the lines up to a blank
    one) passes ``MAX_MESSAGE_BYTES``."""
    size = 0
    while line := response.readline(MAX_MESSAGE_BYTES + 1 - size):
        size = 0 if line.strip() == b"" else size + len(line)
        if size > MAX_MESSAGE_BYTES:
            raise TooLarge
        yield line


def _lost(err: BaseException, method: str, exchange: _Exchange) -> str:
    """Why a POST got no answer: it could not connect, or the connection broke."""
    if not exchange.connected:
        return (f"cannot be reached ({_reason(err)}); check the URL and that the server "
                "is running")
    return (f"gave no answer to {method} ({_reason(err)}); the server or the connection "
            "broke: check the server's log")


def _status_fix(status: int) -> str:
    if status in (401, 403):
        return "check the headers given with the URL (a token the server needs)"
    return "check the server's log" if status >= 500 else PROTOCOL_FIX


def _reason(err: BaseException) -> str:
    """A short reason for a network error: the OS's words, else the exception's."""
    if isinstance(err, socket.gaierror):
        return f"host not found: {err.strerror or err}"
    if isinstance(err, TimeoutError | socket.timeout):
        return "timed out"
    if type(err) is http.client.BadStatusLine:  # its text is the server's raw bytes
        return f"a status line that is not HTTP: {one_line(str(err), 60)}"
    return getattr(err, "strerror", None) or one_line(str(err), 200) or type(err).__name__


def one_line(text: str, limit: int) -> str:
    """``text`` on one printable line of at most about ``limit`` characters (a server's bytes
    may hold anything): quoted with escapes when it is not printable."""
    text = " ".join(text.split())
    return text[:limit] if text.isprintable() else ascii(text[:limit])


def _body_text(raw: bytes) -> str:
    text = one_line(raw.decode("utf-8", errors="replace"), 200)
    return f": {text}" if text else ""
