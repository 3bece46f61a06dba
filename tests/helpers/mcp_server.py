"""A small MCP server for tests/tools/test_mcp.py, run as a real subprocess: JSON-RPC 2.0 over
newline-delimited stdio, as the protocol's stdio transport has it.

Tools: add, echo, fail (answers isError), sleep (each call on its own thread, so calls
overlap; returns when it started and ended), crash (exits with code 3 mid-call), count (the
number of count calls this process served: state kept across episodes).
The tool list comes in two pages (nextCursor). ``--mode``: ``normal``; ``silent`` (reads but
never answers); ``exit`` (exits with code 5 at once, after a line on stderr). ``--only NAME``
lists that tool alone.
"""

import json
import sys
import threading
import time

TOOLS = [
    {"name": "add", "description": "Add two integers.",
     "inputSchema": {"type": "object", "properties": {"a": {"type": "integer"},
                                                      "b": {"type": "integer"}},
                     "required": ["a", "b"]}},
    {"name": "echo", "description": "Repeat a text.",
     "inputSchema": {"type": "object",
                     "properties": {"text": {"type": "string"},
                                    "suffix": {"type": ["string", "null"]}},
                     "required": ["text"]}},
    {"name": "fail", "description": "Always fails.", "inputSchema": {"type": "object"}},
    {"name": "sleep", "description": "Sleep, then say when.",
     "inputSchema": {"type": "object", "properties": {"seconds": {"type": "number"}},
                     "required": ["seconds"]}},
    {"name": "crash", "description": "Exit the server.", "inputSchema": {"type": "object"}},
    {"name": "count", "description": "Count calls.", "inputSchema": {"type": "object"}},
]
COUNT = [0]  # count calls this process served: state that outlives an episode
LOCK = threading.Lock()
SEEN = []  # methods received, in order (the "echo" tool can report them)


def send(message):
    with LOCK:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def text(request_id, value, error=False):
    send({"jsonrpc": "2.0", "id": request_id,
          "result": {"content": [{"type": "text", "text": value}], "isError": error}})


def call(request_id, name, args):
    if name == "add":
        text(request_id, str(args["a"] + args["b"]))
    elif name == "echo":
        text(request_id, args["text"] + (args.get("suffix") or "") + " " + ",".join(SEEN))
    elif name == "fail":
        text(request_id, "deliberate failure", error=True)
    elif name == "sleep":
        start = time.time()
        time.sleep(args["seconds"])
        text(request_id, json.dumps([start, time.time()]))
    elif name == "count":
        with LOCK:
            COUNT[0] += 1
        text(request_id, str(COUNT[0]))
    elif name == "crash":
        print("crashing on purpose", file=sys.stderr, flush=True)
        sys.stdout.flush()
        import os
        os._exit(3)
    else:
        send({"jsonrpc": "2.0", "id": request_id,
              "error": {"code": -32602, "message": f"Unknown tool: {name}"}})


def handle(message):
    method, request_id = message.get("method"), message.get("id")
    SEEN.append(method)
    if request_id is None:  # a notification
        return
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": request_id, "result": {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"tools": {}}, "serverInfo": {"name": "test", "version": "1"}}})
    elif method == "tools/list":
        page = 1 if (message.get("params") or {}).get("cursor") == "page-2" else 0
        result = {"tools": TOOLS[:3] if page == 0 else TOOLS[3:]}
        if "--only" in sys.argv:  # one tool, one page (a short prompt for the tiny model)
            only = sys.argv[sys.argv.index("--only") + 1]
            result = {"tools": [t for t in TOOLS if t["name"] == only] if page == 0 else []}
        if page == 0:
            result["nextCursor"] = "page-2"
        send({"jsonrpc": "2.0", "id": request_id, "result": result})
    elif method == "tools/call":
        params = message["params"]
        threading.Thread(target=call, args=(request_id, params["name"],
                                            params.get("arguments") or {})).start()
    else:
        send({"jsonrpc": "2.0", "id": request_id,
              "error": {"code": -32601, "message": "Method not found"}})


def main():
    mode = sys.argv[sys.argv.index("--mode") + 1] if "--mode" in sys.argv else "normal"
    if mode == "exit":
        print("cannot open the database", file=sys.stderr, flush=True)
        sys.exit(5)
    print("test server ready", file=sys.stderr, flush=True)
    for line in sys.stdin:
        if mode != "silent" and line.strip():
            handle(json.loads(line))


if __name__ == "__main__":
    main()
