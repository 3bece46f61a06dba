"""What the HTTP path costs: requests/s and latency of ``turnrl serve`` vs in-process sampling.

At each concurrency (1, 8, 32 agents by default) two workloads run back to back, each for
``--seconds`` of wall time (so the request count follows this machine's speed), in
``--rounds`` alternating rounds (1 by default; figures are medians over the rounds):

- served: that many agents, each an ``openai.AsyncOpenAI`` client sending single-turn chat
  requests (a short question, ``--max-tokens`` tokens, temperature 1) one after another to a
  live server in this process; the server batches whatever is pending into one engine call;
- in-process: the same prompts, already tokenised, sampled by the same engine in batches of
  that many rows (what the turn loop does), no HTTP, no template rendering, no batching queue.

Per workload: completed requests per second, completion tokens per second, and the p50/p99
latency of one request (served: from send to full reply; in-process: the batch's wall time).
The last line is the served/in-process requests/s ratio at the largest concurrency, after the
machine line; the rounds, percentiles and report lines are the shared harness's
(``benchmarks/harness.py``).

    python benchmarks/speed/serve_throughput.py                                  # tiny model
    python benchmarks/speed/serve_throughput.py --model smollm2-135m-instruct --seconds 20
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
from turnrl.models import configure_torch, load_model
from turnrl.rollout import ChatFormat
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.serve import Server
from turnrl.serve.app import RunningServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Name a number close to {i % 97}."}]


def summary(requests: int, tokens: int, wall: float, latencies: list[float]) -> dict:
    return {"req_s": requests / wall, "tok_s": tokens / wall, "requests": requests,
            "p50_s": statistics.median(latencies), "p99_s": harness.percentile(latencies, 99)}


async def served(base_url: str, model: str, agents: int, seconds: float, max_tokens: int
                 ) -> dict:
    latencies, tokens = [], 0
    deadline = time.perf_counter() + seconds

    async def agent(k: int, client: AsyncOpenAI) -> None:
        nonlocal tokens
        i = k
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            reply = await client.chat.completions.create(model=model, messages=question(i),
                                                         max_tokens=max_tokens)
            latencies.append(time.perf_counter() - start)
            tokens += reply.usage.completion_tokens
            i += agents

    started = time.perf_counter()
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        await asyncio.gather(*(agent(k, client) for k in range(agents)))
    return summary(len(latencies), tokens, time.perf_counter() - started, latencies)


def in_process(engine: HFEngine, chat: ChatFormat, agents: int, seconds: float,
               params: SamplingParams) -> dict:
    latencies, tokens, i = [], 0, 0
    started = time.perf_counter()
    while time.perf_counter() < started + seconds:
        prompts = [chat.encode(chat.render(question(i + k), True)) for k in range(agents)]
        t0 = time.perf_counter()
        completions = engine.generate(prompts, params)
        latencies += [time.perf_counter() - t0] * agents
        tokens += sum(len(c.token_ids) for c in completions)
        i += agents
    return summary(len(latencies), tokens, time.perf_counter() - started, latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--agents", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternating rounds of the two paths per concurrency")
    args = parser.parse_args()
    configure_torch(args.threads)
    model, tokenizer = load_model(args.model)
    chat = ChatFormat(tokenizer)
    params = SamplingParams(args.max_tokens, 1.0, 1.0, stop_token_ids=(chat.end_of_turn,))
    engine = HFEngine(model, tokenizer.pad_token_id, seed=0)
    server = Server(model, chat, engine, name=args.model,
                    max_context=model.config.max_position_embeddings,
                    cfg=ServeConfig(max_tokens=args.max_tokens, max_batch_rows=64))
    levels = [int(x) for x in args.agents.split(",")]
    load = harness.load_average()
    print(f"model {args.model}, {args.max_tokens} tokens a reply, {args.seconds:g} s a cell, "
          f"torch threads {torch.get_num_threads()}, {args.rounds} round(s)")
    print(f"{'agents':>6} {'path':>10} {'req/s':>8} {'tok/s':>8} {'p50 s':>7} {'p99 s':>7} "
          f"{'requests':>8} {'rows/call':>9}")
    rows = {}
    with RunningServer(server) as running:
        asyncio.run(served(running.base_url, args.model, 1, 0.5, args.max_tokens))  # warm-up
        in_process(engine, chat, 1, 0.5, params)
        for agents in levels:
            def serve(agents=agents) -> dict:
                calls, batched = server.batcher.calls, server.batcher.rows
                r = asyncio.run(served(running.base_url, args.model, agents, args.seconds,
                                       args.max_tokens))
                r["rows_per_call"] = (server.batcher.rows - batched) / max(
                    server.batcher.calls - calls, 1)
                return r

            runs = harness.alternate(
                {"served": serve,
                 "in-process": lambda agents=agents: in_process(engine, chat, agents,
                                                                args.seconds, params)},
                args.rounds, warmup=0).results
            rows[agents] = {path: {key: statistics.median(r[key] for r in seen)
                                   for key in seen[0]} for path, seen in runs.items()}
            for path, r in rows[agents].items():
                print(f"{agents:>6} {path:>10} {r['req_s']:>8.2f} {r['tok_s']:>8.1f} "
                      f"{r['p50_s']:>7.3f} {r['p99_s']:>7.3f} {r['requests']:>8g} "
                      f"{r.get('rows_per_call', agents):>9.1f}")
    top = rows[levels[-1]]
    print(harness.machine(load))
    print(harness.ratio_line(f"served / in-process requests/s at {levels[-1]} agents",
                             top["served"]["req_s"] / top["in-process"]["req_s"]))


if __name__ == "__main__":
    main()
