"""MCP servers' tools as typed ``Tool``s: a minimal Model Context Protocol client, over stdio
(``MCPServer``) or Streamable HTTP (``MCPHttpServer``), on the standard library.

stdio: the server is a subprocess; JSON-RPC 2.0 messages go one per line to its stdin and
come back one per line on its stdout (its stderr is its log, kept here as a tail for error
messages). HTTP: each message is POSTed to the server's URL, and a request's answer comes
back as a JSON body or in a ``text/event-stream``; the session id from the answer to
``initialize`` goes with every later message. Either way the client (``MCPClient``) does the
handshake (``initialize``, then the ``notifications/initialized`` notification), lists the
tools (``tools/list``, following ``nextCursor``) and calls them (``tools/call``).

Each listed tool becomes a ``Tool`` whose schema is the server's ``inputSchema``; calling it
sends ``tools/call`` and returns the text of the result's content. So MCP tools go through
``run_tool_calls`` like Python tools: the same argument checks, ``call_timeout_s``
(a call that overruns gets a ``notifications/cancelled`` and a timed-out error observation),
concurrency (calls in flight are told apart by their JSON-RPC ids) and error observations
(a result with ``isError`` or a JSON-RPC error raises ``MCPToolError``).

The server itself failing is not the model's doing: a server that cannot start raises
``MCPServerError`` with the reason (command not found, exit code and stderr tail, URL not
reachable, no answer to ``initialize`` in ``start_timeout_s``); one that exits mid-episode
(HTTP: drops a call's connection, answers an HTTP error, forgets its session) fails its
pending calls and ``ToolEnv.step`` then raises, which fails the episode (``end_reason``
env_error) with the reason. A dead server is started (a lost session opened) afresh on the
next ``reset``. Nothing here waits without a bound: every request has a timeout.

Answers resolve ``concurrent.futures`` futures (stdio: a reader thread per server owns its
stdout; HTTP: a thread per POST), so a call can be awaited from any event loop (each env
runs on its own, ``rollout.env_calls``). ``shared_server`` gives the one client per server
spec that a process's episodes share; ``episode_tools`` gives an episode its own.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import itertools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import urllib.parse
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from turnrl import leftovers
from turnrl.tools.schema import Tool

PROTOCOL_VERSION = "2025-06-18"
STDERR_TAIL = 20
"""Lines of the server's stderr kept for error messages."""


class MCPServerError(RuntimeError):
    """The server could not start, stopped answering the protocol, or exited."""


class MCPToolError(Exception):
    """A tool call the server answered with an error (``isError`` or a JSON-RPC error):
    the model's observation, not a failure of the episode."""


class MCPClient:
    """The transport-independent part of an MCP client: JSON-RPC requests resolved through
    futures, the handshake, the tool listing and the calls. ``MCPServer`` (stdio) and
    ``MCPHttpServer`` (Streamable HTTP) add how messages travel."""

    name: str
    start_timeout_s: float

    def __init__(self) -> None:
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._starting = threading.Lock()
        self._death = ""
        self._listed: list[dict] = []
        self.server_info: dict = {}

    # --- what a transport provides -------------------------------------------------------------

    @property
    def where(self) -> str:
        """The command or URL, for messages."""
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _open(self) -> None:
        """Start the process or the connection (the handshake comes after)."""
        raise NotImplementedError

    def _send(self, message: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Raise ``MCPServerError`` if the server is gone (or was never started)."""
        if self._death:
            raise MCPServerError(self._death)
        if not self.alive:
            raise MCPServerError(f"MCP server '{self.name}' is not running")

    def _detail(self) -> str:
        """More words for a failure (the stdio server's stderr tail)."""
        return ""

    def _abandoned(self, request_id: int) -> None:
        """A request nobody waits for any more (timed out): tell the server."""
        if self.alive:
            try:
                self.notify("notifications/cancelled",
                            {"requestId": request_id, "reason": "timed out"})
            except MCPServerError:
                pass

    # --- life cycle ------------------------------------------------------------------------

    def start(self) -> MCPClient:
        """Open the server and do the handshake and the tool listing; a no-op while it runs."""
        with self._starting:  # envs of concurrent episodes share a server: one starts it
            if not self.alive:
                self._start()
        return self

    def _start(self) -> None:
        try:
            self._open()
            init = self.request("initialize", {
                "protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                "clientInfo": {"name": "turnrl", "version": _version()}},
                self.start_timeout_s)
            self._initialized(init)
            self.notify("notifications/initialized")
            self._listed = self._list_tools()
        except (MCPServerError, MCPToolError) as err:
            self.close()
            reason = str(err).removeprefix(f"MCP server '{self.name}' ")
            raise MCPServerError(f"MCP server '{self.name}' ({self.where}) did "
                                 f"not start: {reason}") from None

    def _initialized(self, result: dict) -> None:
        self.server_info = result.get("serverInfo") or {}

    def _fail_pending(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(MCPServerError(reason))

    # --- JSON-RPC --------------------------------------------------------------------------

    def notify(self, method: str, params: dict | None = None) -> None:
        self._send({"jsonrpc": "2.0", "method": method, **({"params": params} if params
                                                            else {})})

    def _submit(self, method: str, params: dict) -> tuple[int, Future]:
        request_id, future = next(self._ids), Future()
        self._pending[request_id] = future
        try:
            self._send({"jsonrpc": "2.0", "id": request_id, "method": method,
                        "params": params})
        except MCPServerError:
            self._pending.pop(request_id, None)
            raise
        return request_id, future

    def request(self, method: str, params: dict, timeout_s: float) -> dict:
        """Send a request and wait (blocking) for its result, at most ``timeout_s``."""
        request_id, future = self._submit(method, params)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            self._pending.pop(request_id, None)
            self._abandoned(request_id)
            raise MCPServerError(f"no answer to {method} within {timeout_s:g} s"
                                 f"{self._detail()}") from None

    async def arequest(self, method: str, params: dict) -> dict:
        """Send a request and await its result; the caller bounds the wait. A wait that is
        cancelled (a timeout) tells the server with ``notifications/cancelled``."""
        request_id, future = self._submit(method, params)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._pending.pop(request_id, None)
            self._abandoned(request_id)
            raise

    def _dispatch(self, message: dict) -> None:
        if "method" in message:  # the server asks or tells us something
            if "id" in message:  # a request: only ping is ours to answer
                answer = {"result": {}} if message["method"] == "ping" else {
                    "error": {"code": -32601, "message": "method not found"}}
                try:
                    self._send({"jsonrpc": "2.0", "id": message["id"], **answer})
                except MCPServerError:
                    pass
            return
        future = self._pending.pop(message.get("id"), None)
        if future is None or future.done():  # a late answer to a cancelled request
            return
        if "error" in message:
            error = message["error"] if isinstance(message["error"], dict) else {}
            future.set_exception(MCPToolError(
                f"{error.get('message', 'error')} (JSON-RPC error {error.get('code')})"))
        else:
            future.set_result(message.get("result") or {})

    # --- tools -----------------------------------------------------------------------------

    def _list_tools(self) -> list[dict]:
        listed, cursor = [], None
        for _ in range(1000):  # pages; a server that never stops paging is cut off
            result = self.request("tools/list", {"cursor": cursor} if cursor else {},
                                  self.start_timeout_s)
            listed += [t for t in result.get("tools", []) if isinstance(t, dict)
                       and isinstance(t.get("name"), str)]
            cursor = result.get("nextCursor")
            if not cursor:
                break
        return listed

    def tools(self) -> list[Tool]:
        """The server's tools (starting it if needed), each a ``Tool`` calling it."""
        self.start()
        return [self._as_tool(entry) for entry in self._listed]

    def _as_tool(self, entry: dict) -> Tool:
        name = entry["name"]

        async def call(**arguments: Any) -> str:
            return await self.call(name, arguments)

        call.mcp_server = self  # ToolEnv finds the servers its tools need through this
        return Tool(name, entry.get("description") or "", input_schema(entry), call)

    async def call(self, name: str, arguments: dict) -> str:
        """``tools/call``: the result's text; ``MCPToolError`` when the server says the call
        failed, ``MCPServerError`` when the server is gone."""
        result = await self.arequest("tools/call", {"name": name, "arguments": arguments})
        text = result_text(result)
        if result.get("isError"):
            raise MCPToolError(text or "the tool reported an error")
        return text


class MCPServer(MCPClient):
    """One MCP server over stdio: ``start()``, ``tools()``, ``await call(name, arguments)``."""

    def __init__(self, command: str | list[str], *, name: str = "", env: dict | None = None,
                 cwd: str | None = None, start_timeout_s: float = 30.0):
        super().__init__()
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        if not self.command:
            raise ValueError("an MCP server needs a command, e.g. ['python', 'server.py']")
        self.name = name or server_name(self.command)
        self.env, self.cwd, self.start_timeout_s = env, cwd, start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one writer on the server's stdin at a time
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
        self._stderr_reader: threading.Thread | None = None

    @property
    def where(self) -> str:
        return shlex.join(self.command)

    @property
    def alive(self) -> bool:
        return self._proc is not None and not self._death

    def _open(self) -> None:
        with self._lock:
            self._spawn()

    def _spawn(self) -> None:
        self._death, self._pending = "", {}
        self._stderr.clear()
        try:
            # A session of its own: close() stops whatever the server started, too.
            proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=self.cwd, env=self._environ(),
                                    start_new_session=True)
        except OSError as err:
            raise MCPServerError(f"cannot run {shlex.join(self.command)} "
                                 f"({err.strerror or err}); check the command and that the "
                                 "program is installed") from None
        self._proc = proc
        weakref.finalize(self, _stop, proc)
        threading.Thread(target=self._read, args=(proc,), daemon=True,
                         name=f"mcp-{self.name}-out").start()
        self._stderr_reader = threading.Thread(target=self._read_stderr, args=(proc,),
                                               daemon=True, name=f"mcp-{self.name}-err")
        self._stderr_reader.start()

    def _environ(self) -> dict | None:
        return None if self.env is None else {**os.environ, **self.env}

    def close(self) -> None:
        """Stop the server (and what it started); pending calls fail."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _stop(proc)
            self._fail_pending(f"MCP server '{self.name}' was closed")

    def _detail(self) -> str:
        tail = " | ".join(line for line in list(self._stderr)[-5:] if line)
        return f"; its stderr ends: {tail}" if tail else ""

    def _send(self, message: dict) -> None:
        proc = self._proc
        if proc is None or self._death:
            self.check()
        line = json.dumps(message, ensure_ascii=False) + "\n"
        try:
            with self._lock:
                proc.stdin.write(line.encode())
                proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self._died(proc)
            self.check()

    def _read(self, proc: subprocess.Popen) -> None:
        """The reader thread: route each answer to its request until the server's stdout
        closes; then the server is dead and every pending call fails."""
        with proc.stdout:
            for raw in proc.stdout:
                try:
                    message = json.loads(raw)
                except ValueError:
                    self._stderr.append(f"(not JSON on stdout) {raw[:200]!r}")
                    continue
                if isinstance(message, dict):
                    self._dispatch(message)
        self._died(proc)

    def _read_stderr(self, proc: subprocess.Popen) -> None:
        with proc.stderr:
            for raw in proc.stderr:
                self._stderr.append(raw.decode(errors="replace").rstrip()[:300])

    def _died(self, proc: subprocess.Popen) -> None:
        if proc is not self._proc or self._death:
            return
        try:
            code = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:  # stdout closed but still running: stop it
            _stop(proc)
            code = proc.poll()
        # its last words (why it exited) may still be in the pipe: let the reader take them
        self._stderr_reader.join(timeout=1.0)
        self._death = f"MCP server '{self.name}' exited with code {code}{self._detail()}"
        self._fail_pending(self._death)


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
        self._death, self._pending, self._session, self._protocol = "", {}, None, ""
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
            except (OSError, http.client.HTTPException):
                pass
        self._session = None
        self._fail_pending(f"MCP server '{self.name}' was closed")

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
        except (OSError, http.client.HTTPException) as err:
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
        except (OSError, http.client.HTTPException) as err:
            failure = "" if self._pending_answered(request_id) else _lost(err, method, exchange)
        finally:
            exchange.connection.close()
            with self._lock:
                self._exchanges.pop(request_id, None)
        if failure and not exchange.abandoned:
            self._broken(failure)

    def _pending_answered(self, request_id: int) -> bool:
        future = self._pending.get(request_id)
        return future is None or future.done()

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
                    f"{_body_text(text)}")
        if method == "initialize":
            self._session = response.getheader("Mcp-Session-Id") or None
        if kind == "text/event-stream":
            for data in sse_data(response):
                if self._route(data.encode(), request_id):
                    return ""  # our answer came: stop reading (the server may keep it open)
            return f"ended the event stream of {method} without its answer"
        if kind == "application/json":
            if self._route(response.read(), request_id):
                return ""
            return f"answered {method} without its JSON-RPC answer"
        return (f"answered {method} with HTTP {response.status} and Content-Type "
                f"'{kind or 'none'}' (expected application/json or text/event-stream)")

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
        self._fail_pending(self._death)

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


def _lost(err: BaseException, method: str, exchange: _Exchange) -> str:
    """Why a POST got no answer: it could not connect, or the connection broke."""
    if not exchange.connected:
        return (f"cannot be reached ({_reason(err)}); check the URL and that the server "
                "is running")
    return f"gave no answer to {method} ({_reason(err)})"


def _reason(err: BaseException) -> str:
    """A short reason for a network error: the OS's words, else the exception's."""
    if isinstance(err, socket.gaierror):
        return f"host not found: {err.strerror or err}"
    if isinstance(err, TimeoutError | socket.timeout):
        return "timed out"
    return getattr(err, "strerror", None) or str(err) or type(err).__name__


def _body_text(raw: bytes) -> str:
    text = " ".join(raw.decode("utf-8", errors="replace").split())[:200]
    return f": {text}" if text else ""


_LAUNCHERS = {"python", "python3", "node", "npx", "uv", "uvx", "deno", "bun", "pipx"}


def server_name(command: list[str]) -> str:
    """A short name for messages: the program, or the script or package a launcher runs."""
    program = os.path.basename(command[0])
    if program.rstrip("0123456789.") in _LAUNCHERS or program.startswith("python"):
        for arg in command[1:]:
            if arg == "-c":
                break  # inline code has no name
            if not arg.startswith("-") and arg not in ("run", "exec"):
                return os.path.basename(arg)
    return program


def input_schema(entry: dict) -> dict:
    """A tool's ``inputSchema`` in the shape ``Tool`` checks arguments against: an object with
    ``properties`` and ``required``; a nullable type list (["string", "null"]) becomes the
    type and ``nullable``; other type lists are left unchecked."""
    schema = dict(entry.get("inputSchema") or {})
    properties = {}
    for key, prop in (schema.get("properties") or {}).items():
        prop = dict(prop) if isinstance(prop, dict) else {}
        kinds = prop.get("type")
        if isinstance(kinds, list):
            kept = [k for k in kinds if k != "null"]
            prop.pop("type")
            if len(kept) == 1:
                prop["type"] = kept[0]
            if "null" in kinds:
                prop["nullable"] = True
        properties[key] = prop
    required = [r for r in schema.get("required") or [] if r in properties]
    return {**schema, "type": "object", "properties": properties, "required": required}


def result_text(result: dict) -> str:
    """The text of a ``tools/call`` result: its text parts joined; other parts described
    (an image by its MIME type, a resource by its text or URI); else the structured content."""
    parts = []
    for item in result.get("content") or []:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            parts.append(str(item.get("text", "")))
        elif kind == "resource":
            resource = item.get("resource") or {}
            parts.append(str(resource.get("text") or f"[resource {resource.get('uri')}]"))
        elif kind is not None:
            parts.append(f"[{kind} {item.get('mimeType') or item.get('uri') or ''}]".strip())
    if not parts and result.get("structuredContent") is not None:
        return json.dumps(result["structuredContent"], ensure_ascii=False)
    return "\n".join(parts)


def tool_servers(tools: Any) -> list[MCPClient]:
    """The MCP servers behind ``tools`` (a list or name -> Tool dict), each once."""
    found = {}
    for t in tools.values() if isinstance(tools, dict) else tools:
        server = getattr(t.fn, "mcp_server", None)
        if server is not None:
            found[id(server)] = server
    return list(found.values())


ServerSpec = str | list | dict
"""How a config names a server: a command (a string or an argv list), an ``http(s)://`` URL,
or a mapping ``{command: ...}`` or ``{url: ..., headers: {...}}``."""


def parse_spec(spec: ServerSpec) -> tuple[str, tuple, tuple]:
    """``("stdio", argv, ())`` or ``("http", (url,), headers)`` for a server spec; a
    ``ValueError`` naming the problem for anything else."""
    if isinstance(spec, str) and re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", spec.strip()):
        spec = {"url": spec.strip()}  # any scheme: a URL (the client names the ones it speaks)
    if isinstance(spec, dict):
        unknown = set(spec) - {"command", "url", "headers"}
        if unknown or ("command" in spec) == ("url" in spec):
            raise ValueError(f"MCP server {spec!r}: give either command (a program and its "
                             "arguments) or url (http://HOST:PORT/PATH, with optional headers)"
                             + (f", not {', '.join(sorted(unknown))}" if unknown else ""))
        if "command" in spec:
            if "headers" in spec:
                raise ValueError(f"MCP server {spec!r}: headers go with a url, not a command")
            return parse_spec(spec["command"])
        headers = spec.get("headers") or {}
        if not isinstance(headers, dict) or not isinstance(spec["url"], str):
            raise ValueError(f"MCP server {spec!r}: url must be a string and headers a mapping "
                             "of header names to values")
        return "http", (spec["url"],), tuple(sorted((str(k), str(v)) for k, v in headers.items()))
    if isinstance(spec, str):
        argv = shlex.split(spec)
    elif isinstance(spec, list | tuple) and all(isinstance(a, str | int | float) for a in spec):
        argv = [str(a) for a in spec]
    else:
        argv = []
    if not argv:
        raise ValueError(f"MCP server {spec!r} is not a command, a URL or a mapping; give e.g. "
                         "\"python server.py\" or http://localhost:8000/mcp")
    return "stdio", tuple(argv), ()


def new_server(spec: ServerSpec, start_timeout_s: float = 30.0,
               cwd: str | None = None) -> MCPClient:
    """A client (not started) for a server spec: ``MCPServer`` or ``MCPHttpServer``."""
    kind, target, headers = parse_spec(spec)
    if kind == "http":
        return MCPHttpServer(target[0], headers=dict(headers), start_timeout_s=start_timeout_s)
    return MCPServer(list(target), cwd=cwd, start_timeout_s=start_timeout_s)


_SHARED: dict[tuple, MCPClient] = {}
_SHARED_LOCK = threading.Lock()
_EPISODE_SERVERS: weakref.WeakSet = weakref.WeakSet()


def shared_server(spec: ServerSpec, start_timeout_s: float = 30.0,
                  cwd: str | None = None) -> MCPClient:
    """The process's one client for ``spec`` (envs are made per episode; the server is
    started once and shared by them, and closed when the command ends)."""
    key = (parse_spec(spec), cwd)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = new_server(spec, start_timeout_s, cwd)
        return _SHARED[key]


def episode_tools(spec: ServerSpec, start_timeout_s: float = 30.0,
                  cwd: str | None = None) -> list[Tool]:
    """Tools bound to a server of their own, for one episode: a new process (stdio) or a new
    session (HTTP), started when the env resets and closed when the episode ends (the
    owning ``ToolEnv``'s ``close``). The tool list comes from the shared server (started
    once), so making an env costs no start-up."""
    template = shared_server(spec, start_timeout_s, cwd).start()
    server = new_server(spec, start_timeout_s, cwd)
    _EPISODE_SERVERS.add(server)
    return [server._as_tool(entry) for entry in template._listed]


def close_shared_servers() -> None:
    """Close the shared servers and any per-episode server still open."""
    with _SHARED_LOCK:
        servers = [*_SHARED.values(), *list(_EPISODE_SERVERS)]
        _SHARED.clear()
    for server in servers:
        server.close()


leftovers.CLOSE_AT_END.append(close_shared_servers)


def _stop(proc: subprocess.Popen) -> None:
    """Close stdin (the protocol's shutdown), then SIGTERM and SIGKILL the server's session.
    Its stdout and stderr are closed by their reader threads, at their end."""
    try:
        proc.stdin.close()
    except OSError:
        pass
    if proc.poll() is None:
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except OSError:
                    pass
                try:
                    proc.wait(timeout=2.0)
                    break
                except subprocess.TimeoutExpired:
                    continue


def _version() -> str:
    """TurnRL's installed version, for ``clientInfo`` (the package itself is not imported
    here: it imports the envs, which import this module)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("turnrl")
    except PackageNotFoundError:
        return "unknown"
