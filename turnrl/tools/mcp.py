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

import collections
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import weakref
from typing import Any

from turnrl import leftovers
from turnrl.tools.mcp_client import (  # noqa: F401 - the client's names, re-exported
    PROTOCOL_VERSION,
    STDERR_TAIL,
    MCPClient,
    MCPServerError,
    MCPToolError,
    _version,
    input_schema,
    result_text,
)
from turnrl.tools.mcp_http import MCPHttpServer, sse_data  # noqa: F401 - re-exported
from turnrl.tools.schema import Tool

MAX_MESSAGE_BYTES = 64 << 20
"""The longest line read from a stdio server's stdout (one JSON-RPC message)."""


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
        self.max_message_bytes = MAX_MESSAGE_BYTES

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
        closes; then the server is dead and every pending call fails. A line over
        ``max_message_bytes`` stops the server (nothing after it could be trusted)."""
        cap = self.max_message_bytes
        with proc.stdout:
            while raw := proc.stdout.readline(cap + 1):
                if len(raw) > cap and not raw.endswith(b"\n"):
                    self._died(proc, f"sent a message over {cap} bytes on stdout (raise "
                                     f"MCPServer.max_message_bytes if its answers are that big)")
                    return
                self._take(raw)
        self._died(proc)

    def _take(self, raw: bytes) -> None:
        """One line of the server's stdout: a message is dispatched; anything else is named
        in the stderr tail that error messages show."""
        try:
            message = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested past the stack
            if raw.strip():
                self._stderr.append(f"(not JSON on stdout) {raw[:200]!r}")
            return
        if isinstance(message, dict):
            self._dispatch(message)
        else:
            self._stderr.append(f"(not a JSON-RPC message on stdout) {raw[:200]!r}")

    def _unanswerable(self, message: dict) -> None:
        self._stderr.append(f"(an answer with id {json.dumps(message.get('id'))[:60]} on "
                            "stdout, which no request has)")

    def _read_stderr(self, proc: subprocess.Popen) -> None:
        """Keep the tail of the server's stderr, each line on one line and cut short; read
        in bounded pieces (a flood without line ends never piles up here)."""
        with proc.stderr:
            while raw := proc.stderr.readline(4096):
                text = " ".join(raw.decode(errors="replace").split())[:300]
                if text:
                    self._stderr.append(text)

    def _died(self, proc: subprocess.Popen, why: str = "") -> None:
        """The server's stdout closed (or broke the protocol: ``why``): no answer can come
        any more. Say so at once, then wait for its exit code (or stop it) and fail every
        pending call with the reason."""
        if proc is not self._proc or self._death:
            return
        self._death = f"MCP server '{self.name}' {why or 'closed its stdout'}"
        if why:
            self._death += self._detail()
            self._fail_pending(self._death)
            _stop(proc)
            return
        try:
            what = f"exited with code {proc.wait(timeout=2.0)}"
        except subprocess.TimeoutExpired:  # stdout closed but still running: stop it
            _stop(proc)
            what = "closed its stdout but kept running (stopped)"
        # its last words (why it exited) may still be in the pipe: let the reader take them
        self._stderr_reader.join(timeout=1.0)
        if proc is self._proc:  # not replaced by a fresh start meanwhile
            self._death = f"MCP server '{self.name}' {what}{self._detail()}"
            self._fail_pending(self._death)

    def _fix(self) -> str:
        return (f"; check that `{self.where}` starts an MCP server that answers JSON-RPC on "
                "stdout, one message a line")


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
