"""MCP costs with the test servers: a stdio server's start (spawn, handshake, tool listing),
an HTTP session's start, and the latency of one tool call over stdio, HTTP with JSON answers
and HTTP with event-stream answers (median of sequential ``add`` calls).

Each transport is timed in its turn, not in alternating rounds (a server's start is a one-off
per run); the timing, the machine line and the last line, ``ratio: HTTP json / stdio call
latency = X``, are the shared harness's (``benchmarks/harness.py``).

    PYTHONPATH=. python benchmarks/speed/mcp_calls.py [--calls 50] [--starts 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

from turnrl.tools.mcp.client import MCPClient
from turnrl.tools.mcp.http import MCPHttpServer
from turnrl.tools.mcp.stdio import MCPServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

TESTS = Path(__file__).resolve().parents[2] / "tests"


def timed_start(server: MCPClient) -> float:
    return harness.timed(server.start)[0]


def call_latency_ms(server: MCPClient, calls: int) -> float:
    add = {t.name: t for t in server.tools()}["add"]

    async def run() -> list[float]:
        seconds = []
        for i in range(calls):
            started = time.perf_counter()
            await add.fn(a=i, b=1)
            seconds.append(time.perf_counter() - started)
        return seconds

    return 1000 * statistics.median(asyncio.run(run()))


def http_server(answer: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(TESTS / "helpers" / "mcp_http_server.py"), "--answer",
                             answer], stdout=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{int(proc.stdout.readline().split()[1])}/mcp"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--starts", type=int, default=10)
    args = parser.parse_args(argv)
    load = harness.load_average()
    stdio = [sys.executable, str(TESTS / "helpers" / "mcp_server.py")]
    starts = []
    for _ in range(args.starts):
        server = MCPServer(stdio)
        starts.append(timed_start(server))
        server.close()
    print(f"stdio server start (spawn, handshake, listing): {statistics.median(starts):.3f} s "
          f"median of {args.starts}")
    server = MCPServer(stdio)
    latencies = {"stdio": call_latency_ms(server, args.calls)}
    print(f"stdio call: {latencies['stdio']:.2f} ms median of {args.calls}")
    server.close()
    for answer in ("json", "sse"):
        proc, url = http_server(answer)
        try:
            client = MCPHttpServer(url)
            start = timed_start(client)
            latency = latencies[answer] = call_latency_ms(client, args.calls)
            client.close()
        finally:
            proc.kill()
            proc.wait()
        print(f"HTTP ({answer} answers): session start {start:.3f} s, call {latency:.2f} ms "
              f"median of {args.calls}")
    print(harness.machine(load))
    print(harness.ratio_line("HTTP json / stdio call latency",
                             latencies["json"] / latencies["stdio"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
