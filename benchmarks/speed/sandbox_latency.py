"""What a sandboxed tool call costs: the ``python`` tool through bubblewrap and the fallback.

Side by side in one run, the same trivial program (``print(6 * 7)``) as a parsed
``<tool_call>`` through ``run_tool_calls``, so the figure is what ToolEnv pays per call:

1. latency, one call at a time: median and p99 over ``--calls`` calls per backend, next to
   a bare ``python -I -c`` subprocess of the same interpreter (no limits, no isolation);
2. throughput: ``--calls`` calls with ``--concurrency`` in flight (default 2, the cores of
   the laptop this was written on), calls per second.

Backends alternate in rounds so drift on a shared machine hits both alike.
Usage: ``python benchmarks/speed/sandbox_latency.py [--calls 60] [--concurrency 2]``. The last
line is ``ratio: bwrap / fallback median latency = X``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from turnrl.sandbox import Limits, Sandbox
from turnrl.sandbox.backends import bwrap_problem
from turnrl.tools import parse_tool_calls, python_tool, run_tool_calls

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

CALL = ('<tool_call>' + json.dumps({"name": "python", "arguments": {"code": "print(6 * 7)"}})
        + '</tool_call>')


async def _one(tool) -> float:
    started = time.perf_counter()
    (result,) = await run_tool_calls(parse_tool_calls(CALL), [tool])
    if result.content != "42\n":
        raise RuntimeError(f"the sandboxed call failed: {result}")
    return time.perf_counter() - started


async def _bare(python: str) -> float:
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(python, "-I", "-c", "print(6 * 7)",
                                                stdout=asyncio.subprocess.PIPE)
    await proc.communicate()
    return time.perf_counter() - started


async def _throughput(tool, calls: int, concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def gated():
        async with gate:
            await _one(tool)

    started = time.perf_counter()
    await asyncio.gather(*(gated() for _ in range(calls)))
    return calls / (time.perf_counter() - started)


async def main(calls: int, concurrency: int, rounds: int) -> None:
    backends = ["fallback"] + ([] if bwrap_problem() else ["bwrap"])
    if bwrap_problem():
        print(f"bwrap skipped: {bwrap_problem()}")
    # one interpreter for all (the fallback's: as root it must be runnable by any user id)
    python = Sandbox("fallback").python
    sandboxes = {b: Sandbox(b, Limits(wall_s=10.0, cpu_s=5.0), python) for b in backends}
    tools = {b: python_tool(s) for b, s in sandboxes.items()}
    pythons = {"bare subprocess, no sandbox": python}
    print(f"interpreter: {python}")
    load = harness.load_average()
    for tool in tools.values():  # warm caches (interpreter probe, page cache)
        await _one(tool)
    latency = {name: [] for name in [*tools, *pythons]}
    rate = {name: [] for name in tools}
    per_round = max(1, calls // rounds)
    for _ in range(rounds):
        for name, tool in tools.items():
            latency[name] += [await _one(tool) for _ in range(per_round)]
            rate[name].append(await _throughput(tool, per_round, concurrency))
        for name, python in pythons.items():
            latency[name] += [await _bare(python) for _ in range(per_round)]
    print(f"{'':44s} {'median ms':>10s} {'p99 ms':>8s} {'calls/s @' + str(concurrency):>12s}")
    for name, values in latency.items():
        cps = f"{statistics.median(rate[name]):12.1f}" if name in rate else f"{'':12s}"
        print(f"{name:44s} {1e3 * statistics.median(values):10.1f} "
              f"{1e3 * harness.percentile(values, 99):8.1f} {cps}")
    print(harness.machine(load))
    if "bwrap" in latency:
        ratio = harness.ratio_of_medians(latency["bwrap"], latency["fallback"])
        print(harness.ratio_line("bwrap / fallback median latency", ratio))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=60, help="calls per backend and measure")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.concurrency, args.rounds))
    sys.exit(0)
