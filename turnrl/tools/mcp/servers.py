"""Which server a config names (``ServerSpec``: a command, a URL or a mapping), and who owns
its client: ``shared_server`` gives the one client per spec that a process's episodes share,
``episode_tools`` an episode its own; both are closed when the command ends."""

from __future__ import annotations

import re
import shlex
import threading
import weakref
from typing import Any

from turnrl import leftovers
from turnrl.tools.mcp.client import MCPClient, mcp_tool
from turnrl.tools.mcp.http import MCPHttpServer
from turnrl.tools.mcp.stdio import MCPServer
from turnrl.tools.schema import Tool


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
    return [mcp_tool(server, entry) for entry in template._listed]


def close_shared_servers() -> None:
    """Close the shared servers and any per-episode server still open."""
    with _SHARED_LOCK:
        servers = [*_SHARED.values(), *list(_EPISODE_SERVERS)]
        _SHARED.clear()
    for server in servers:
        server.close()


leftovers.CLOSE_AT_END.append(close_shared_servers)
