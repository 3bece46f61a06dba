"""First streamed token of Anthropic's ``/v1/messages`` beside ``/v1/chat/completions``, each
through its official client (``anthropic``, ``openai``) against one live ``turnrl serve`` (the
tiny model by default), and whether every recorded reply's token ids are the ones sampled.

Each round sends the same greedy streamed request (``--tokens`` tokens) once through each API's
client, and once as plain HTTP (httpx: the server's part without the client libraries), in
alternating rounds (``benchmarks/harness.py``); a request's figure is the seconds
from the call to its first text (``text_delta`` / ``delta.content``), and to its last event.
Every call carries an episode id; at the end each recorded reply is compared, token for
token, with what the engine sampled. Prints medians, the machine line and ``ratio: messages /
chat first-token seconds = X [interval]``. Usage:
``python benchmarks/speed/messages_latency.py [--model smollm2-135m-instruct] [--rounds 10]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch
from anthropic import Anthropic
from openai import OpenAI

from turnrl.config import ServeConfig
from turnrl.models import load_model
from turnrl.rollout import ChatFormat
from turnrl.samplers import HFEngine
from turnrl.serve import Server
from turnrl.serve.app import RunningServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

ASK = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
_ids = itertools.count()


class KeptEngine(HFEngine):
    """The engine, keeping every sampled row (what the recordings are checked against)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sampled: list[list[int]] = []

    def generate(self, prompts, params, on_step=None):
        out = super().generate(prompts, params, on_step)
        self.sampled += [list(c.token_ids) for c in out]
        return out


def chat_call(client: OpenAI, tokens: int) -> tuple[float, float, str]:
    """(seconds to the first text, seconds to the end, episode id)."""
    episode = f"chat-{next(_ids)}"
    start, first = time.perf_counter(), None
    for chunk in client.chat.completions.create(
            model="served", messages=ASK, max_tokens=tokens, temperature=0, stream=True,
            extra_body={"turnrl_episode": episode}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start, episode


def messages_call(client: Anthropic, tokens: int) -> tuple[float, float, str]:
    episode = f"messages-{next(_ids)}"
    start, first = time.perf_counter(), None
    for event in client.messages.create(model="served", messages=ASK, max_tokens=tokens,
                                        stream=True, extra_body={"temperature": 0,
                                                                 "turnrl_episode": episode}):
        if first is None and event.type == "content_block_delta":
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start, episode


def raw_call(http: httpx.Client, path: str, body: dict, is_text) -> tuple[float, float, str]:
    """The same request as plain HTTP (no client library): ``is_text(event)`` spots the
    first event carrying text."""
    episode = f"raw-{next(_ids)}"
    start, first = time.perf_counter(), None
    with http.stream("POST", path, json={**body, "turnrl_episode": episode}) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and is_text(json.loads(line[6:])):
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start, episode


def _chat_text(event: dict) -> bool:
    return bool(event["choices"] and event["choices"][0]["delta"].get("content"))


def _messages_text(event: dict) -> bool:
    return event["type"] == "content_block_delta"


def exact(server: Server, episodes: list[str]) -> int:
    """How many of ``episodes`` recorded exactly the ids the engine sampled for them."""
    deadline = time.monotonic() + 10  # a stream ends just before its engine call returns
    while len(server.engine.sampled) < len(episodes) and time.monotonic() < deadline:
        time.sleep(0.01)
    found = 0
    for episode in episodes:
        (segment,) = server.recorder.episodes[episode].segments
        found += all(segment.token_ids[s:e] in server.engine.sampled for s, e in segment.spans)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    engine = KeptEngine(model, tokenizer.pad_token_id, seed=0)
    server = Server(model, ChatFormat(tokenizer), engine, name="served",
                    max_context=getattr(model.config, "max_position_embeddings", None),
                    cfg=ServeConfig(max_tokens=args.tokens))
    load = harness.load_average()
    with RunningServer(server) as running:
        chat = OpenAI(base_url=running.base_url, api_key="x", max_retries=0)
        claude = Anthropic(base_url=running.base_url.removesuffix("/v1"), api_key="x",
                           max_retries=0)
        http = httpx.Client(base_url=running.base_url, timeout=600)
        body = {"model": "served", "messages": ASK, "max_tokens": args.tokens,
                "temperature": 0, "stream": True}
        runs = harness.alternate({
            "chat completions": lambda: chat_call(chat, args.tokens),
            "messages": lambda: messages_call(claude, args.tokens),
            "chat, plain http": lambda: raw_call(http, "/chat/completions", body, _chat_text),
            "messages, plain http": lambda: raw_call(http, "/messages", body, _messages_text)},
            args.rounds, warmup=1, flip=True).results
        episodes = list(server.recorder.episodes)  # the warm-ups' too
        same = exact(server, episodes)
    print(f"model {args.model}, {args.tokens} greedy tokens a reply, {args.threads} thread(s), "
          f"{args.rounds} rounds; medians (min-max)")
    firsts = {label: [r[0] for r in seen] for label, seen in runs.items()}
    for label, seen in runs.items():
        low, high = harness.spread(firsts[label])
        print(f"  {label:20s} first text {statistics.median(firsts[label]):.4f} s "
              f"({low:.4f}-{high:.4f}), whole reply {statistics.median(r[1] for r in seen):.4f} s")
    print(f"  recorded ids equal the sampled ones: {same}/{len(episodes)} replies")
    print(harness.interval_line("messages / chat first-token seconds", firsts["messages"],
                                firsts["chat completions"]))
    print(harness.interval_line("the same, plain http", firsts["messages, plain http"],
                                firsts["chat, plain http"]))
    print(harness.machine(load))
    print(harness.ratio_line("messages / chat first-token seconds", harness.ratio_of_medians(
        firsts["messages"], firsts["chat completions"])))
    return 0 if same == len(episodes) else 1


if __name__ == "__main__":
    sys.exit(main())
