"""The stdio transport: the MCP server is a subprocess; JSON-RPC 2.0 messages go one per line
to its stdin and come back one per line on its stdout (its stderr is its log, kept as a tail
for error messages). A reader thread per server owns its stdout (the package docstring says
how the client behaves)."""

from __future__ import annotations

import collections
import json
import os
import shlex
import signal
import subprocess
import threading
import weakref

from turnrl.tools.mcp.client import STDERR_TAIL, MCPClient
from turnrl.tools.mcp.errors import MCPServerError

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
        self._death = ""
        self._pending.drop()
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
            self._pending.fail_all(f"MCP server '{self.name}' was closed")

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
            self._pending.fail_all(self._death)
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
            self._pending.fail_all(self._death)

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
