"""The two ways an MCP server fails a caller: the server itself (``MCPServerError``: the
episode fails) or one tool call (``MCPToolError``: the model's observation)."""

from __future__ import annotations


class MCPServerError(RuntimeError):
    """The server could not start, stopped answering the protocol, or exited."""


class MCPToolError(Exception):
    """A tool call the server answered with an error (``isError`` or a JSON-RPC error):
    the model's observation, not a failure of the episode."""
