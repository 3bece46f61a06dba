"""Time to first token of a request sent while a long reply is being generated, with a
waiting request joining the running batch at the next decode step (the default) vs
waiting for the batch to end (``Batcher.join_running = False``).

A live server (the tiny model by default) and the official ``openai`` client: a streamed
request for ``--long`` tokens; once its first token arrives, a streamed request for
``--short`` tokens; we time the short one's first content chunk and what was left of the
long one. Both modes alternate, ``--repeats`` times (after one short warm-up request);
medians, then the shared harness's machine line and ``ratio: waits / joins first-token
seconds = X`` (``benchmarks/harness.py``). Usage: ``python benchmarks/speed/stream_latency.py [--model smollm2-135m-instruct]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch
from openai import AsyncOpenAI

from turnrl.config import ServeConfig
from turnrl.models import load_model
from turnrl.rollout import ChatFormat
from turnrl.samplers import HFEngine
from turnrl.serve import Server
from turnrl.serve.app import RunningServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

ASK = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


async def first_content(stream) -> float:
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return time.perf_counter()
    return time.perf_counter()


async def once(base_url: str, long: int, short: int) -> tuple[float, float]:
    """(seconds to the short request's first token, seconds the long one still ran)."""
    async with AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        ask = dict(model="served", messages=ASK, stream=True, temperature=1.0)
        long_stream = await client.chat.completions.create(**ask, max_tokens=long)
        await first_content(long_stream)
        sent = time.perf_counter()
        rest = asyncio.create_task(drain(long_stream))
        short_stream = await client.chat.completions.create(**ask, max_tokens=short)
        first = await first_content(short_stream)
        await drain(short_stream)
        return first - sent, await rest - sent


async def drain(stream) -> float:
    async for _ in stream:
        pass
    return time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--long", type=int, default=400)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    chat = ChatFormat(tokenizer)
    server = Server(model, chat, HFEngine(model, tokenizer.pad_token_id, seed=0),
                    name="served", max_context=getattr(model.config, "max_position_embeddings",
                                                       None),
                    cfg=ServeConfig(max_tokens=args.short))
    load = harness.load_average()
    with RunningServer(server) as running:
        asyncio.run(once(running.base_url, 4, 2))  # warm-up

        def mode(join: bool):
            def run() -> tuple[float, float]:
                server.batcher.join_running = join
                return asyncio.run(once(running.base_url, args.long, args.short))
            return run

        runs = harness.alternate({"joins the batch": mode(True),
                                  "waits for its end": mode(False)},
                                 args.repeats, warmup=0).results
    print(f"model {args.model}, long {args.long} tokens, short {args.short}, {args.threads} "
          f"thread(s), {args.repeats} repeats; medians")
    for label, seen in runs.items():
        first = statistics.median(r[0] for r in seen)
        left = statistics.median(r[1] for r in seen)
        print(f"  {label:18s} first token of the short request {first:.3f} s "
              f"(long reply still ran {left:.3f} s)")
    firsts = {label: [r[0] for r in seen] for label, seen in runs.items()}
    print(harness.machine(load))
    print(harness.ratio_line("waits / joins first-token seconds", harness.ratio_of_medians(
        firsts["waits for its end"], firsts["joins the batch"])))


if __name__ == "__main__":
    main()
