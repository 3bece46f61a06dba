"""The transport-independent half of TurnRL's MCP client: the handshake, tool listing and
calls over JSON-RPC 2.0 (``MCPClient``), and how MCP's tool entries and results become
TurnRL's. The requests awaiting answers are ``PendingRequests`` (``pending.py``), the errors
are in ``errors.py``. The transports: stdio in ``stdio.py`` (``MCPServer``), Streamable HTTP
in ``http.py`` (``MCPHttpServer``); the package docstring (``__init__.py``) says
how the whole client behaves."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from turnrl.tools.mcp.errors import MCPServerError, MCPToolError
from turnrl.tools.mcp.pending import PendingRequests
from turnrl.tools.schema import Tool

PROTOCOL_VERSION = "2025-06-18"
STDERR_TAIL = 20
"""Lines of the server's stderr kept for error messages."""


class MCPClient:
    """The transport-independent part of an MCP client: the handshake, JSON-RPC requests
    (their futures kept by ``PendingRequests``), the tool listing and the calls.
    ``MCPServer`` (stdio) and ``MCPHttpServer`` (Streamable HTTP) add how messages travel."""

    name: str
    start_timeout_s: float

    def __init__(self) -> None:
        self._pending = PendingRequests()
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

    def _fix(self) -> str:
        """What to do when the server does not start (said after the reason)."""
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
            self._listed = listed_tools(self)
        except (MCPServerError, MCPToolError) as err:
            self.close()
            reason = str(err).removeprefix(f"MCP server '{self.name}' ")
            fix = "" if "; check " in reason else self._fix()
            raise MCPServerError(f"MCP server '{self.name}' ({self.where}) did "
                                 f"not start: {reason}{fix}") from None

    def _initialized(self, result: dict) -> None:
        self.server_info = result.get("serverInfo") or {}

    # --- JSON-RPC --------------------------------------------------------------------------

    def notify(self, method: str, params: dict | None = None) -> None:
        self._send({"jsonrpc": "2.0", "method": method, **({"params": params} if params
                                                            else {})})

    def request(self, method: str, params: dict, timeout_s: float) -> dict:
        """Send a request and wait (blocking) for its result, at most ``timeout_s``."""
        request_id, future = self._pending.submit(method, params, self._send)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            self._pending.forget(request_id)
            self._abandoned(request_id)
            raise MCPServerError(self._death or (
                f"no answer to {method} within {timeout_s:g} s{self._detail()}; check that "
                "the server answers MCP, or raise the env's start_timeout_s")) from None

    async def arequest(self, method: str, params: dict) -> dict:
        """Send a request and await its result; the caller bounds the wait. A wait that is
        cancelled (a timeout) tells the server with ``notifications/cancelled``."""
        request_id, future = self._pending.submit(method, params, self._send)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._pending.forget(request_id)
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
        request_id = message.get("id")
        if not isinstance(request_id, int | str):  # no request of ours has such an id
            self._unanswerable(message)
            return
        self._pending.resolve(message, self.where)

    def _unanswerable(self, message: dict) -> None:
        """An answer whose id no request can have: named in the failure detail."""

    def tools(self) -> list[Tool]:
        """The server's tools (starting it if needed), each a ``Tool`` calling it."""
        self.start()
        return [mcp_tool(self, entry) for entry in self._listed]

    async def call(self, name: str, arguments: dict) -> str:
        """``tools/call``: the result's text; ``MCPToolError`` when the server says the call
        failed, ``MCPServerError`` when the server is gone."""
        result = await self.arequest("tools/call", {"name": name, "arguments": arguments})
        text = result_text(result)
        if result.get("isError"):
            raise MCPToolError(text or "the tool reported an error")
        return text


def listed_tools(client: MCPClient) -> list[dict]:
    """Every tool entry ``tools/list`` gives, page by page (a server that never stops paging is
    cut off at 1000 pages); entries without a string name are left out."""
    listed, cursor = [], None
    for _ in range(1000):
        result = client.request("tools/list", {"cursor": cursor} if cursor else {},
                                client.start_timeout_s)
        tools = result.get("tools") or []
        listed += [t for t in tools if isinstance(t, dict)
                   and isinstance(t.get("name"), str)] if isinstance(tools, list) else []
        cursor = result.get("nextCursor")
        if not cursor:
            break
    return listed


def mcp_tool(client: MCPClient, entry: dict) -> Tool:
    """The ``Tool`` that calls ``entry``'s tool on ``client``'s server."""
    name = entry["name"]

    async def call(**arguments: Any) -> str:
        return await client.call(name, arguments)

    call.mcp_server = client  # ToolEnv finds the servers its tools need through this
    return Tool(name, entry.get("description") or "", input_schema(entry), call)


def input_schema(entry: dict) -> dict:
    """A tool's ``inputSchema`` in the shape ``Tool`` checks arguments against: an object with
    ``properties`` and ``required``; a nullable type list (["string", "null"]) becomes the
    type and ``nullable``; other type lists are left unchecked."""
    schema = entry.get("inputSchema")
    schema = dict(schema) if isinstance(schema, dict) else {}  # a server's garbage: unchecked
    given = schema.get("properties")
    properties = {}
    for key, prop in (given if isinstance(given, dict) else {}).items():
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
    required = schema.get("required")
    required = [r for r in required if isinstance(r, str) and r in properties] \
        if isinstance(required, list) else []
    return {**schema, "type": "object", "properties": properties, "required": required}


def result_text(result: dict) -> str:
    """The text of a ``tools/call`` result: its text parts joined; other parts described
    (an image by its MIME type, a resource by its text or URI); else the structured content."""
    parts = []
    content = result.get("content")
    for item in content if isinstance(content, list) else []:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            parts.append(str(item.get("text", "")))
        elif kind == "resource":
            resource = item.get("resource")
            resource = resource if isinstance(resource, dict) else {}
            parts.append(str(resource.get("text") or f"[resource {resource.get('uri')}]"))
        elif kind is not None:
            parts.append(f"[{kind} {item.get('mimeType') or item.get('uri') or ''}]".strip())
    if not parts and result.get("structuredContent") is not None:
        return json.dumps(result["structuredContent"], ensure_ascii=False)
    return "\n".join(parts)


def _version() -> str:
    """TurnRL's installed version, for ``clientInfo`` (the package itself is not imported
    here: it imports the envs, which import this module)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("turnrl")
    except PackageNotFoundError:
        return "unknown"
