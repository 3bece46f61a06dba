"""First streamed token of ``POST /v1/responses`` beside ``POST /v1/chat/completions``: what the
Responses layer (translating the input items, its event sequence) adds to a streamed reply.

A live server (the tiny model by default) and the official ``openai`` client send the same
conversation both ways (``instructions`` + ``input`` vs a system and a user message: the same
rendered prompt), streamed, ``--tokens`` tokens at temperature 1, recorded into an episode as
an agent's calls are. Per request: seconds from sending to the first text (a
``response.output_text.delta`` event, a chunk with ``delta.content``) and to the end of the
stream. The two APIs alternate over ``--repeats`` rounds (after a warm-up of each); medians,
the shared harness's machine line, then ``ratio: responses / chat first-token seconds = X``
(``benchmarks/harness.py``). Usage: ``python benchmarks/speed/responses_latency.py [--model
smollm2-135m-instruct]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from itertools import count
from pathlib import Path

import torch
from openai import OpenAI

from turnrl.config import ServeConfig
from turnrl.models import load_model
from turnrl.rollout import ChatFormat
from turnrl.samplers import HFEngine
from turnrl.serve import Server
from turnrl.serve.app import RunningServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer in a few sentences."
ASK = "Tell me a short story about a lighthouse keeper and a storm."
episodes = count()


def chat(client: OpenAI, tokens: int) -> tuple[float, float]:
    """(seconds to the first content chunk, seconds to the end) of one streamed completion."""
    sent, first = time.perf_counter(), None
    stream = client.chat.completions.create(
        model="served", messages=[{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": ASK}],
        max_tokens=tokens, temperature=1.0, stream=True,
        extra_body={"turnrl_episode": f"chat-{next(episodes)}"})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - sent, end - sent


def responses(client: OpenAI, tokens: int) -> tuple[float, float]:
    """The same for one streamed response (its first ``response.output_text.delta``)."""
    sent, first = time.perf_counter(), None
    stream = client.responses.create(
        model="served", instructions=SYSTEM, input=ASK, max_output_tokens=tokens,
        temperature=1.0, stream=True,
        extra_body={"turnrl_episode": f"responses-{next(episodes)}"})
    for event in stream:
        if first is None and event.type == "response.output_text.delta":
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - sent, end - sent


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    """Run the benchmark; each API's (first text, whole stream) seconds, a round each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    server = Server(model, ChatFormat(tokenizer), HFEngine(model, tokenizer.pad_token_id, seed=0),
                    name="served", max_context=getattr(model.config, "max_position_embeddings",
                                                       None),
                    cfg=ServeConfig(max_tokens=args.tokens))
    load = harness.load_average()
    with RunningServer(server) as running:
        client = OpenAI(base_url=running.base_url, api_key="x", max_retries=0)
        runs = harness.alternate({"chat completions": lambda: chat(client, args.tokens),
                                  "responses": lambda: responses(client, args.tokens)},
                                 args.repeats, warmup=1, flip=True).results
    print(f"model {args.model}, {args.tokens} tokens a reply, {args.threads} thread(s), "
          f"{args.repeats} rounds; medians")
    for label, seen in runs.items():
        first = statistics.median(r[0] for r in seen)
        whole = statistics.median(r[1] for r in seen)
        print(f"  {label:17s} first text {first * 1000:7.1f} ms, whole stream "
              f"{whole * 1000:7.1f} ms")
    firsts = {label: [r[0] for r in seen] for label, seen in runs.items()}
    print(harness.machine(load))
    print(harness.interval_line("responses / chat first-token seconds",
                                firsts["responses"], firsts["chat completions"]))
    print(harness.ratio_line("responses / chat first-token seconds", harness.ratio_of_medians(
        firsts["responses"], firsts["chat completions"])))
    return runs


if __name__ == "__main__":
    main()
