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

Modules: ``client`` (the protocol both transports share: ``MCPClient``), ``pending`` (the
requests awaiting answers: ``PendingRequests``), ``errors`` (``MCPServerError``,
``MCPToolError``), ``stdio`` (``MCPServer``), ``http`` (``MCPHttpServer``) and ``servers``
(a config's server specs; the shared and per-episode clients).
"""
