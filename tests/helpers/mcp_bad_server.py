"""An MCP stdio server that misbehaves, for tests/sandbox/test_subprocess_fuzz.py: run as a real
subprocess. ``--how HOW --when PHASE --seed N``: it answers the protocol normally (one tool,
``poke``, that answers "poked") until PHASE (``initialize`` or ``call``), then does HOW:

random_bytes: random bytes (newlines included), then the right answer; invalid_utf8: a line
that is not UTF-8, then the right answer; not_object: JSON values that are not messages
(a number, a list, a string), then the right answer; deep_json: a list nested 200,000 deep,
then the right answer; huge_line: 2 MB with no newline, then
silence; truncated: half of the answer, no newline, then exit 3; exit_mid: half the answer,
then exit 4 at once; close_stdout: closes its stdout and keeps running; silent: never
answers; stderr_flood: 5 MB on stderr (long lines and no line ends), then the right answer;
bad_result: an answer whose result is not an object; bad_id: answers with an id that is a
list or object, then silence.
"""

import json
import os
import random
import sys
import time

TOOL = {"name": "poke", "description": "Say poked.", "inputSchema": {"type": "object"}}


def write(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def answer(request_id, method) -> bytes:
    if method == "initialize":
        result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                  "serverInfo": {"name": "bad", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": [TOOL]}
    else:
        result = {"content": [{"type": "text", "text": "poked"}]}
    return (json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}) + "\n").encode()


def misbehave(how: str, rng: random.Random, request_id, method) -> None:
    right = answer(request_id, method)
    if how == "random_bytes":
        write(rng.randbytes(rng.randint(1, 4000)) + b"\n" + right)
    elif how == "invalid_utf8":
        write(b'{"jsonrpc": "2.0", "id": ' + str(request_id).encode() + b', "result": "\xff\xfe"}\n'
              + right)
    elif how == "deep_json":
        write(b"[" * 200_000 + b"]" * 200_000 + b"\n" + right)
    elif how == "not_object":
        write(b"5\n[1, 2]\n\"text\"\nnull\n" + right)
    elif how == "huge_line":
        write(b"x" * (2 << 20))
        time.sleep(60)
    elif how in ("truncated", "exit_mid"):
        write(right[:rng.randint(1, len(right) - 2)])
        if how == "truncated":
            sys.exit(3)
        os._exit(4)
    elif how == "close_stdout":
        os.close(1)
        sys.stdout = open(os.devnull, "w")
        time.sleep(60)
    elif how == "silent":
        time.sleep(60)
    elif how == "stderr_flood":
        err = sys.stderr.buffer
        for _ in range(5):
            err.write(rng.randbytes(1 << 20))  # no line ends to speak of
        err.write(b"\n" + b"long " * 100_000 + b"\n")
        err.flush()
        write(right)
    elif how == "bad_result":
        write(json.dumps({"jsonrpc": "2.0", "id": request_id,
                          "result": rng.choice([5, "text", [1], None, True])}).encode() + b"\n")
    elif how == "bad_id":
        write(json.dumps({"jsonrpc": "2.0", "id": [request_id], "result": {}}).encode() + b"\n"
              + json.dumps({"jsonrpc": "2.0", "id": {"a": 1}, "result": {}}).encode() + b"\n")
        time.sleep(60)


def main() -> None:
    args = dict(zip(sys.argv[1::2], sys.argv[2::2], strict=True))
    how, when, rng = args["--how"], args["--when"], random.Random(int(args["--seed"]))
    for line in sys.stdin:
        message = json.loads(line)
        method, request_id = message.get("method"), message.get("id")
        if request_id is None:
            continue
        if method == when or (when == "call" and method == "tools/call"):
            misbehave(how, rng, request_id, method)
        else:
            write(answer(request_id, method))


if __name__ == "__main__":
    main()
