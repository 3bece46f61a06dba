"""The requests an MCP client has sent and not yet had answered: their JSON-RPC ids, the
futures their callers wait on, and how an answer resolves one. Kept apart from the client's
life cycle and from the transports (stdio, HTTP), which only hand answers in and fail them all
when the server goes."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from concurrent.futures import Future

from turnrl.tools.mcp.errors import MCPServerError, MCPToolError


class PendingRequests:
    """Request id -> the future its caller waits on. Ids count up for the client's lifetime
    (a fresh start keeps counting), so a late answer to a request of an earlier session never
    matches a new one."""

    def __init__(self) -> None:
        self.futures: dict[int, Future] = {}
        self._ids = itertools.count(1)

    def submit(self, method: str, params: dict, send: Callable[[dict], None]
               ) -> tuple[int, Future]:
        """Send a request with ``send`` under a new id; its id and the future its answer
        resolves (``method`` is named if that answer is malformed). A request that cannot be
        sent (``MCPServerError``) is not kept."""
        request_id, future = next(self._ids), Future()
        future.method = method
        self.futures[request_id] = future
        try:
            send({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
        except MCPServerError:
            self.forget(request_id)
            raise
        return request_id, future

    def forget(self, request_id: int) -> None:
        """Nobody waits for ``request_id`` any more (it timed out, or could not be sent)."""
        self.futures.pop(request_id, None)

    def answered(self, request_id: int) -> bool:
        """Whether ``request_id`` has its answer (or was forgotten)."""
        future = self.futures.get(request_id)
        return future is None or future.done()

    def drop(self) -> None:
        """Forget every request without failing it (a fresh start of the server)."""
        self.futures = {}

    def fail_all(self, reason: str) -> None:
        """Every pending request fails with ``MCPServerError(reason)`` (the server is gone)."""
        pending, self.futures = self.futures, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(MCPServerError(reason))

    def resolve(self, message: dict, where: str) -> None:
        """An answer (``message`` has an int or string id): its request's future gets the
        result, or ``MCPToolError`` for a JSON-RPC error or a result that is not an object
        (the call's error: an observation mid-episode); ``where`` names the server. A late
        answer to a cancelled request is dropped."""
        future = self.futures.pop(message.get("id"), None)
        if future is None or future.done():
            return
        result = message.get("result", {})
        if "error" in message:
            error = message["error"] if isinstance(message["error"], dict) else {}
            future.set_exception(MCPToolError(
                f"{error.get('message', 'error')} (JSON-RPC error {error.get('code')})"))
        elif not isinstance(result, dict):
            future.set_exception(MCPToolError(
                f"answered {getattr(future, 'method', 'the request')} with a result that is "
                f"not an object ({type(result).__name__}: {json.dumps(result)[:100]}); "
                f"check that {where} is an MCP server"))
        else:
            future.set_result(result or {})
