"""Live token streaming and tool_choice of ``turnrl serve``, driven by the official ``openai``
client against live servers: tokens arrive while they are generated, the streamed text is the
plain reply's, stop strings and tool-call tags are held back, a request joins a running batch,
tool_choice "required" / a named function is forced in the prompt (and so never trained on),
"none" gives no calls."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
import torch
from openai import AsyncOpenAI, OpenAI
from transformers import AutoTokenizer

from turnrl.config import ServeConfig
from turnrl.models import SMOLLM2, model_directory, tiny_model, tiny_tokenizer
from turnrl.rollout import ChatFormat
from turnrl.samplers import Completion, HFEngine, SamplingParams
from turnrl.serve import Server
from turnrl.serve.app import RunningServer
from turnrl.serve.prompt import forced_call
from turnrl.serve.stream import CALL_TAG, ReplyStream, byte_token_ids, held_suffix, safe_text

USER = [{"role": "user", "content": "Tell me a story."}]
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {
                                            "a": {"type": "integer"},
                                            "b": {"type": "integer"}},
                                            "required": ["a", "b"]}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def tiny_server(**cfg) -> Server:
    model, tokenizer = tiny_model(seed=0)
    return Server(model, ChatFormat(tokenizer), HFEngine(model, tokenizer.pad_token_id, seed=0),
                  name="tiny", max_context=model.config.max_position_embeddings,
                  cfg=ServeConfig(max_tokens=16, **cfg))


class StepEngine:
    """Writes scripted replies a token per step through the live-token hook, pausing
    ``step_s`` a step (the tiny random model cannot write a tool call). Keeps the prompts."""

    def __init__(self, tokenizer, replies: list[str], step_s: float = 0.02):
        self.tokenizer, self.replies, self.step_s = tokenizer, replies, step_s
        self.version, self.calls, self.prompts = 0, 0, []
        self.last_step = 0.0

    def generate(self, prompts, params, on_step=None):
        self.prompts += [list(p) for p in prompts]
        text = self.replies[self.calls % len(self.replies)]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [
            self.tokenizer.eos_token_id]
        out = [Completion() for _ in prompts]
        for token in ids[:params.max_new_tokens]:
            time.sleep(self.step_s)
            for c in out:
                c.token_ids.append(token)
                c.logprobs.append(-0.5)
                c.finish_reason = "stop" if token in params.stop_token_ids else "length"
            self.last_step = time.perf_counter()
            if on_step is not None and on_step([(r, token, -0.5) for r in range(len(prompts))]):
                break
        return out


def scripted(replies: list[str], **cfg) -> Server:
    tokenizer = tiny_tokenizer()
    return Server(torch.nn.Linear(1, 1), ChatFormat(tokenizer), StepEngine(tokenizer, replies),
                  name="tiny", max_context=1024, cfg=ServeConfig(max_tokens=128, **cfg))


def collect(stream, chunks: list | None = None) -> tuple[str, list, list, list[float]]:
    """(content, tool-call deltas, finish reasons, arrival time of each content chunk),
    read as the chunks arrive; ``chunks`` gets them."""
    text, calls, finishes, times = "", [], [], []
    for chunk in stream:
        if chunks is not None:
            chunks.append(chunk)
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            text += choice.delta.content
            times.append(time.perf_counter())
        calls += choice.delta.tool_calls or []
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    return text, calls, finishes, times


# ---- what can be sent before the reply is final (pure) -----------------------------------


def test_safe_text_holds_back_what_later_tokens_may_change():
    assert held_suffix("hello wor", ("world",)) == 3 and held_suffix("hello", ("xy",)) == 0
    assert safe_text("hello wor", ("world",)) == "hello "  # may be the start of a stop
    assert safe_text("hello world and more", ("world",)) == "hello "  # never past a stop
    assert safe_text("abc", ("abcd", "c")) == ""  # "c" is complete but "abcd" may come first
    assert safe_text("caf\ufffd", ()) == "caf"  # a character whose bytes are still coming
    assert safe_text("Sure.\n<tool", (), (CALL_TAG,), hold_space=True) == "Sure."
    assert safe_text('Sure. <tool_call>{"name"', (), (CALL_TAG,), hold_space=True) == "Sure."
    assert safe_text("ok", ()) == "ok"


def test_a_stream_never_sends_a_broken_character():
    tokenizer = AutoTokenizer.from_pretrained(model_directory(SMOLLM2), local_files_only=True)
    text = "Café 😀 is 日本語, ok? Stop here: END and never this."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text.encode())  # so some tokens hold partial characters
    stream = ReplyStream(tokenizer.decode, ("END",), (), hidden=(tokenizer.eos_token_id,))
    pieces, token_count = [], 0
    for i, token in enumerate(ids + [tokenizer.eos_token_id]):
        stream.add(token, -0.1 * i)
        new, new_ids, logprobs = stream.take()
        assert "\ufffd" not in new and "END" not in new and len(new_ids) == len(logprobs)
        pieces.append(new)
        token_count += len(new_ids)
    final = text[:text.index("END")]  # what the server's stop-string cut returns
    assert "".join(pieces) + stream.rest(final) == final
    assert "".join(pieces) == "Café 😀 is 日本語, ok? Stop here: "  # all sent early
    assert token_count == stream.sent_tokens and 0 < token_count <= len(ids)


# ---- the engine's per-step hook ---------------------------------------------------------


def test_the_engine_hook_reports_every_token_and_changes_nothing_sampled():
    model, tokenizer = tiny_model(seed=0)
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [10, 11, 12, 13, 14]]
    params = SamplingParams(24, 1.0, 1.0, stop_token_ids=(tokenizer.eos_token_id,))
    plain = HFEngine(model, tokenizer.pad_token_id, seed=3).generate(prompts, params)
    seen: list[list[int]] = [[] for _ in prompts]

    def on_step(tokens):
        for row, token, _ in tokens:
            seen[row].append(token)

    hooked = HFEngine(model, tokenizer.pad_token_id, seed=3).generate(prompts, params, on_step)
    assert hooked == plain and seen == [c.token_ids for c in plain]
    # True from the hook ends the call after that step; the rows continue from kept keys.
    engine = HFEngine(model, tokenizer.pad_token_id, seed=3)
    steps = []
    cut = engine.generate(prompts, params, lambda tokens: steps.append(1) or len(steps) == 5)
    assert all(len(c.token_ids) <= 5 for c in cut) and len(steps) == 5
    assert max(len(c.token_ids) for c in cut) == 5
    resumed = [p + c.token_ids for p, c in zip(prompts, cut, strict=True)]
    kept = engine._kept.match(resumed)
    assert all(k is not None and len(k.tokens) == len(p) - 1 for k, p in zip(kept, resumed,
                                                                               strict=True))


# ---- live streaming through the endpoint --------------------------------------------------


@pytest.fixture(scope="module")
def twins():
    """Two identical servers (same weights, same seed): a call on each samples the same."""
    torch.set_num_threads(1)
    with RunningServer(tiny_server()) as a, RunningServer(tiny_server()) as b:
        yield [OpenAI(base_url=r.base_url, api_key="x", max_retries=0) for r in (a, b)], (a, b)


def test_tokens_arrive_while_generated_and_add_up_to_the_plain_reply(twins):
    (plain, live), _ = twins
    for client in (plain, live):  # warm both up alike (the first forward pass is slow)
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    ask = dict(model="tiny", messages=USER, max_tokens=160, temperature=1.0, logprobs=True)
    reply = plain.chat.completions.create(**ask).choices[0]
    started, chunks = time.perf_counter(), []
    text, _, finishes, times = collect(live.chat.completions.create(**ask, stream=True), chunks)
    assert text == reply.message.content and finishes == [reply.finish_reason]
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in reply.logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in
                                                           reply.logprobs.content])
    # Live: chunks spread over the generation, the first long before the last (all at once
    # at the end would put them within a few ms of each other).
    assert len(set(times)) >= 20
    assert times[-1] - times[0] > 0.5 * (times[-1] - started)


def test_stop_strings_are_never_streamed(twins):
    (plain, live), _ = twins
    ask = dict(model="tiny", messages=USER, max_tokens=60, temperature=1.0)
    sampled = plain.chat.completions.create(**ask).choices[0].message.content
    live.chat.completions.create(**ask)  # the same draw on the twin: both stay in step
    stop = sampled[20:23]
    cut = plain.chat.completions.create(**ask, stop=[stop]).choices[0]
    text, _, finishes, _ = collect(live.chat.completions.create(**ask, stop=[stop],
                                                                 stream=True))
    assert text == cut.message.content and stop not in text and finishes == ["stop"]


def test_a_request_joins_a_running_batch_instead_of_waiting_for_it(twins):
    _, (running, _) = twins
    batcher = running.server.batcher
    joins = batcher.joins

    async def race() -> tuple[float, float, int]:
        async with AsyncOpenAI(base_url=running.base_url, api_key="x", max_retries=0) as c:
            # Greedy: the tiny model's reply to USER never ends before max_tokens.
            long = await c.chat.completions.create(model="tiny", messages=USER, stream=True,
                                                   max_tokens=400, temperature=0)
            first = asyncio.Event()

            async def read_long() -> tuple[float, int]:
                count = 0
                async for chunk in long:
                    if chunk.choices and chunk.choices[0].delta.content:
                        count += 1
                        first.set()
                return time.perf_counter(), count

            reader = asyncio.create_task(read_long())
            await first.wait()
            await c.chat.completions.create(model="tiny", messages=USER, max_tokens=3,
                                            temperature=0)
            short_done = time.perf_counter()
            long_done, count = await reader
            return short_done, long_done, count

    short_done, long_done, count = asyncio.run(race())
    assert short_done < long_done and count > 1
    assert batcher.joins > joins  # the long call stopped at a step and took the short one in


def test_tool_calls_stream_as_tool_calls_deltas_and_content_comes_first():
    server = scripted(["Let me add these.\n" + CALL])
    with RunningServer(server) as running:
        client = OpenAI(base_url=running.base_url, api_key="x", max_retries=0)
        text, calls, finishes, times = collect(client.chat.completions.create(
            model="tiny", messages=USER, tools=[ADD], stream=True))
    assert text == "Let me add these." and finishes == ["tool_calls"]
    (call,) = calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2,
                                                                                    "b": 3}
    assert call.id and call.type == "function" and call.index == 0
    assert times[0] < server.engine.last_step - 1.0  # the content came while the call was
    # being written (its ~60 tokens take 20 ms each)


# ---- tool_choice --------------------------------------------------------------------------


def test_tool_choice_required_and_named_are_forced_in_the_prompt_and_get_no_loss():
    named = {"type": "function", "function": {"name": "add"}}
    assert forced_call("hermes", "required") == '<tool_call>\n{"name": "'
    assert forced_call("hermes", named) == '<tool_call>\n{"name": "add", "arguments": '
    assert forced_call("llama3-json", named) == '{"name": "add", "parameters": '
    assert forced_call("hermes", "auto") == forced_call("hermes", "none") == ""
    # The model only writes what follows the forced opening.
    server = scripted(['add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
                      '{"a": 4, "b": 5}}\n</tool_call>', "It is 9."])
    tokenizer = server.tokenizer
    with RunningServer(server) as running:
        client = OpenAI(base_url=running.base_url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "Add 2 and 3, then 4 and 5."}]
        first = client.chat.completions.create(model="tiny", messages=messages, tools=[ADD],
                                               tool_choice="required",
                                               extra_body={"turnrl_episode": "forced"})
        (call,) = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls"
        assert (call.function.name, json.loads(call.function.arguments)) == ("add",
                                                                             {"a": 2, "b": 3})
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = client.chat.completions.create(model="tiny", messages=messages, tools=[ADD],
                                                tool_choice=named, stream=True,
                                                extra_body={"turnrl_episode": "forced"})
        text, calls, finishes, _ = collect(second)
        assert text == "" and finishes == ["tool_calls"]
        assert json.loads(calls[0].function.arguments) == {"a": 4, "b": 5}
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function", "function": {
                "name": "add", "arguments": calls[0].function.arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "9"}]
        last = client.chat.completions.create(model="tiny", messages=messages, tools=[ADD],
                                              extra_body={"turnrl_episode": "forced"})
        assert last.choices[0].message.content == "It is 9."
    first_prompt, second_prompt, _ = (tokenizer.decode(p) for p in server.engine.prompts)
    assert first_prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "')
    assert second_prompt.endswith('<tool_call>\n{"name": "add", "arguments": ')
    # The three calls make one sequence; the forced openings are prompt tokens: mask 0.
    (segment,) = server.recorder.episodes["forced"].segments
    trained = tokenizer.decode([t for t, m in zip(segment.token_ids, segment.loss_mask,
                                                  strict=True) if m])
    assert trained == ('add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
                       '{"a": 4, "b": 5}}\n</tool_call><|im_end|>It is 9.<|im_end|>')
    assert (CALL.replace('"a": 2, "b": 3', '"a": 4, "b": 5') + "<|im_end|>"
            in tokenizer.decode(segment.token_ids))


def test_tool_choice_none_gives_no_calls_and_bad_choices_are_400():
    server = scripted([CALL])
    with RunningServer(server) as running:
        client = OpenAI(base_url=running.base_url, api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=USER, tools=[ADD],
                                               tool_choice="none").choices[0]
        assert reply.message.tool_calls is None and reply.message.content == CALL
        assert reply.finish_reason == "stop"
        assert "<tools>" not in server.tokenizer.decode(server.engine.prompts[-1])
        text, calls, _, _ = collect(client.chat.completions.create(
            model="tiny", messages=USER, tools=[ADD], tool_choice="none", stream=True))
        assert text == CALL and not calls
        for choice, says in [({"type": "function", "function": {"name": "mul"}}, "'mul'"),
                             ({"type": "function"}, "tool_choice"), ("always", "required")]:
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="tiny", messages=USER, tools=[ADD],
                                               tool_choice=choice)
            assert says in err.value.body["message"] and err.value.body["param"] == \
                "tool_choice"
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=USER,
                                           tool_choice="required")
        assert "no 'tools'" in err.value.body["message"]
    assert server.engine.calls == 2  # the refused requests never reached the engine


def test_the_batcher_hands_tokens_from_the_engine_thread_to_the_loop():
    """Live tokens reach the loop in order, one hand-off a step, even when the engine's
    thread races the loop (no lost or reordered tokens)."""
    server = scripted(["abcdefghij" * 4])
    server.engine.step_s = 0.0
    assert server.batcher.live_tokens

    async def run() -> list[str]:
        task = asyncio.create_task(server.batcher.run())
        params = SamplingParams(64, 1.0, 1.0, stop_token_ids=(server.chat.end_of_turn,))
        queues = [asyncio.Queue() for _ in range(4)]
        ids = server.chat.encode("hi")
        await asyncio.gather(*(server.batcher.generate(ids, params, 1, q) for q in queues))
        task.cancel()
        out = []
        for q in queues:
            tokens = []
            while (event := q.get_nowait()) is not None:
                tokens.append(event[1])
            out.append(server.tokenizer.decode(tokens))
        return out

    assert asyncio.run(run()) == ["abcdefghij" * 4 + "<|im_end|>"] * 4


def test_a_run_of_byte_tokens_is_sent_only_once_settled():
    """SentencePiece-style byte fallback (the tiny tokenizer's): a later byte can turn a
    whole run into U+FFFD, so a run's text waits for the token that ends it."""
    tokenizer = tiny_tokenizer()
    byte = tokenizer.convert_tokens_to_ids
    ids = [byte("A"), byte("<0xD1>"), byte("<0x92>"), byte("<0x80>"), byte("b")]
    assert tokenizer.decode(ids[:3]) == "Aђ" and tokenizer.decode(ids) == "A\ufffd\ufffd\ufffdb"
    stream = ReplyStream(tokenizer.decode, (), (), hidden=(),
                         byte_tokens=byte_token_ids(tokenizer))
    sent = ""
    for token in ids:
        stream.add(token, -1.0)
        sent += stream.take()[0]
        assert tokenizer.decode(ids).startswith(sent)
    assert sent == "A\ufffd\ufffd\ufffdb" and stream.sent_tokens == len(ids)


def test_top_logprobs_rank_the_alternatives_of_each_token(twins):
    (client, twin), _ = twins
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8,
                                           temperature=0, logprobs=True, top_logprobs=3)
    twin.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens - (reply.choices[0].finish_reason
                                                            == "stop")
    for entry in entries:
        top = entry.top_logprobs
        assert len(top) == 3 and top[0].logprob >= top[1].logprob >= top[2].logprob
        # Greedy: the served token is the likeliest, with its log-probability.
        assert top[0].token == entry.token
        assert top[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    for extra, says in [(dict(top_logprobs=21), "top_logprobs"),
                        (dict(top_logprobs=2, logprobs=False), "logprobs=true"),
                        (dict(top_logprobs=2, stream=True), "stream")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**{"model": "tiny", "messages": USER,
                                              "logprobs": True, **extra})
        assert says in err.value.body["message"]
