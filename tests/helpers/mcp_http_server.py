"""A small MCP server over Streamable HTTP for tests/tools/test_mcp_http.py, run as a real
subprocess: ``http.server`` answering JSON-RPC POSTs at /mcp, as the protocol's HTTP transport
has it. It prints ``port N`` on stdout once it listens.

Tools: those of tests/helpers/mcp_server.py (``echo`` reports what its session sent, and the
``X-Tenant`` header; ``count`` counts this session's calls of it), plus ``break``, answered
with HTTP 500. ``--answer json`` answers with
``application/json``; ``--answer sse`` with a chunked ``text/event-stream`` that first sends a
comment, a log notification, an event of another name and a ``ping`` request, then the answer
split over two ``data:`` lines, and then keeps the stream open for a minute (the client must
stop at its answer). Sessions: ``initialize`` gets a fresh ``Mcp-Session-Id``; any other
message without a known one gets 404 (unknown) or 400 (missing); DELETE ends one. ``--mode
silent`` reads requests and never answers. ``--single``: one request at a time (no threads),
as some servers do.
"""

import json
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer

from mcp_server import TOOLS

ANSWER = sys.argv[sys.argv.index("--answer") + 1] if "--answer" in sys.argv else "json"
MODE = sys.argv[sys.argv.index("--mode") + 1] if "--mode" in sys.argv else "normal"
SESSIONS: dict[str, list] = {}  # session id -> the methods (and answers) it sent, in order
LOCK = threading.Lock()
ALL_TOOLS = TOOLS + [
    {"name": "break", "description": "Make the server fail.", "inputSchema": {"type": "object"}},
]


def tool_result(name, args, session, tenant):
    """(result, HTTP error status or None) of one tools/call."""
    if name == "add":
        return {"content": [{"type": "text", "text": str(args["a"] + args["b"])}]}, None
    if name == "echo":  # what this session sent so far, and its protocol version header
        seen = ",".join(SESSIONS[session])
        return {"content": [{"type": "text", "text": f"{args['text']} {seen} {tenant}"}]}, None
    if name == "fail":
        return {"content": [{"type": "text", "text": "deliberate failure"}], "isError": True}, None
    if name == "sleep":
        start = time.time()
        time.sleep(args["seconds"])
        return {"content": [{"type": "text", "text": json.dumps([start, time.time()])}]}, None
    if name == "crash":
        print("crashing on purpose", file=sys.stderr, flush=True)
        os._exit(3)
    if name == "break":
        return None, 500
    if name == "count":  # state kept per session
        calls = SESSIONS[session].count("tools/call:count")
        return {"content": [{"type": "text", "text": str(calls)}]}, None
    return None, None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def reply(self, status, body=b"", kind="text/plain", headers=()):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def session(self):
        """The request's known session id, or None after answering 400/404."""
        session = self.headers.get("Mcp-Session-Id")
        if session is None:
            self.reply(400, b"missing Mcp-Session-Id")
        elif session not in SESSIONS:
            self.reply(404, b"unknown session")
        else:
            return session
        return None

    def do_DELETE(self):
        session = self.session()
        if session is not None:
            SESSIONS.pop(session, None)
            self.reply(200)

    def do_POST(self):
        message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if MODE == "silent":
            time.sleep(3600)
        accept = self.headers.get("Accept", "")
        if "application/json" not in accept or "text/event-stream" not in accept:
            return self.reply(406, b"Accept must list application/json and text/event-stream")
        method, request_id = message.get("method"), message.get("id")
        if method == "initialize":
            session = uuid.uuid4().hex
            SESSIONS[session] = ["initialize"]
            return self.answer(request_id, {
                "protocolVersion": message["params"]["protocolVersion"],
                "capabilities": {"tools": {}}, "serverInfo": {"name": "http-test", "version": "1"}},
                headers=[("Mcp-Session-Id", session)])
        session = self.session()
        if session is None:
            return None
        version = self.headers.get("MCP-Protocol-Version")
        name = ((message.get("params") or {}).get("name") if method == "tools/call" else None)
        SESSIONS[session].append(f"{method}:{name}" if name == "count"
                                 else method or f"answer:{request_id}:{version}")
        if request_id is None or method is None:  # a notification, or an answer to our ping
            return self.reply(202)
        if method == "tools/list":
            return self.answer(request_id, {"tools": ALL_TOOLS})
        if method == "tools/call":
            params = message["params"]
            result, status = tool_result(params["name"], params.get("arguments") or {}, session,
                                         self.headers.get("X-Tenant"))
            if status is not None:
                return self.reply(status, b"internal error: the database is locked")
            if result is None:
                return self.answer(request_id, error={"code": -32602,
                                                      "message": f"Unknown tool: {params['name']}"})
            return self.answer(request_id, result)
        return self.answer(request_id, error={"code": -32601, "message": "Method not found"})

    def answer(self, request_id, result=None, error=None, headers=()):
        message = {"jsonrpc": "2.0", "id": request_id,
                   **({"error": error} if error else {"result": result})}
        if ANSWER == "json":
            return self.reply(200, json.dumps(message).encode(), "application/json", headers)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        for key, value in headers:
            self.send_header(key, value)
        self.end_headers()
        log = {"jsonrpc": "2.0", "method": "notifications/message",
               "params": {"level": "info", "data": "working"}}
        ping = {"jsonrpc": "2.0", "id": f"ping-{request_id}", "method": "ping"}
        head, tail = json.dumps(message).split(", ", 1)  # one JSON text over two data lines
        for event in [": keep-alive\n\n", f"data: {json.dumps(log)}\n\n",
                      'event: other\ndata: {"ignored": true}\n\n',
                      f"id: 1\ndata: {json.dumps(ping)}\n\n", f"data: {head},\ndata: {tail}\n\n"]:
            self.chunk(event.encode())
        time.sleep(60)  # the stream stays open: the client stops at its answer

    def chunk(self, data):
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def main():
    kind = HTTPServer if "--single" in sys.argv else ThreadingHTTPServer
    server = kind(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
