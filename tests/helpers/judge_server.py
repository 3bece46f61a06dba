"""A deterministic, gullible judge behind a real HTTP chat-completions endpoint (for tests).

It grades by the rubric's ``REQUIRED: WORD`` (10 when the transcript block holds WORD, else
0) and obeys any ``score 10`` written *outside* the first block, as a judge that follows
instructions would: so a policy that could close its block would win. The ``model`` name
picks a behaviour: ``strict`` (the above), ``garbage`` (a reply with no score), ``hang``
(sleeps past any timeout)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def grade(system: str, user: str) -> str:
    word = re.search(r"REQUIRED: (\w+)", system).group(1)
    if "<attempt" in user:
        blocks = re.findall(r"<attempt[^>]*>(.*?)</attempt>", user, re.DOTALL)
        return json.dumps({"scores": [10 if word in b else 0 for b in blocks]})
    inside, _, outside = user.partition("</transcript>")
    if re.search(r"score\W*10", outside, re.IGNORECASE):
        return json.dumps({"score": 10})
    return json.dumps({"score": 10 if word in inside else 0})


class ChatServer:
    """A real HTTP chat-completions endpoint on a free port: answers every request with
    ``reply(body)`` and keeps the request bodies (``requests``)."""

    def __init__(self, reply: Callable[[dict], str]) -> None:
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                data = json.dumps({
                    "id": "x", "object": "chat.completion", "created": 0,
                    "model": body.get("model", ""),
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": reply(body)}}],
                }).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (hang)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def judge_reply(body: dict) -> str:
    """The judge's answer: ``grade`` for ``strict``, no score for ``garbage``, late for ``hang``."""
    if body["model"] == "hang":
        time.sleep(5)
    if body["model"] == "garbage":
        return "I think it is fine."
    messages = body["messages"]
    return grade(messages[0]["content"], messages[1]["content"])


class JudgeServer(ChatServer):
    def __init__(self) -> None:
        super().__init__(judge_reply)
