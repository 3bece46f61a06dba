"""Anthropic's Messages API on ``turnrl serve``, driven by the official ``anthropic`` client
against live servers on the tiny model (and a scripted one where a tool call must be
written): replies and streams, system prompts, tools, stop reasons, errors in Anthropic's
shape, the recording (exact sampled ids, calls merged into one sequence) and a short
``train_agent`` run whose agent speaks only the Messages API."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import anthropic
import pytest
import torch
from anthropic import Anthropic, AsyncAnthropic
from openai import OpenAI

from tests.serve.test_serve import post, tiny_server
from tests.serve.test_stream import scripted
from turnrl.config import load_config
from turnrl.models import tiny_model
from turnrl.samplers import HFEngine
from turnrl.serve import messages
from turnrl.serve.app import RunningServer
from turnrl.serve.messages import anthropic_env, chat_messages, chat_tools
from turnrl.serve.train import train_agent

USER = [{"role": "user", "content": "Say a digit."}]
ADD = {"name": "add", "description": "Add two integers.", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
GREEDY = {"temperature": 0}  # anthropic 2.x has no temperature argument: the body carries it


class KeptEngine(HFEngine):
    """The real engine, keeping what it sampled (to compare with what was recorded)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sampled: list[list[int]] = []

    def generate(self, prompts, params, on_step=None):
        out = super().generate(prompts, params, on_step)
        self.sampled += [list(c.token_ids) for c in out]
        return out


def client_of(running, **kw) -> Anthropic:
    return Anthropic(base_url=running.base_url.removesuffix("/v1"), api_key=kw.pop("key", "x"),
                     max_retries=0, **kw)


@pytest.fixture(scope="module")
def live():
    torch.set_num_threads(2)
    server = tiny_server()
    server.engine = server.batcher.engine = KeptEngine(server.model,
                                                       server.tokenizer.pad_token_id, seed=0)
    with RunningServer(server) as running:
        yield running, client_of(running)


def test_a_message_and_its_stream_give_the_same_greedy_reply(live):
    running, client = live
    plain = client.messages.create(model="tiny", max_tokens=8, messages=USER, system="Be brief.",
                                   extra_body=GREEDY)
    assert plain.type == "message" and plain.role == "assistant" and plain.model == "tiny"
    (block,) = plain.content
    assert block.type == "text" and block.text
    assert plain.stop_reason == "max_tokens" and plain.usage.output_tokens == 8
    tokenizer = running.server.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *USER],
                                           tokenize=False, add_generation_prompt=True)
    assert plain.usage.input_tokens == len(tokenizer(prompt, add_special_tokens=False)
                                           ["input_ids"])
    kinds = []
    with client.messages.stream(model="tiny", max_tokens=8, messages=USER, extra_body=GREEDY,
                                system=[{"type": "text", "text": "Be "},
                                        {"type": "text", "text": "brief."}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == block.text and final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == plain.usage.input_tokens
    assert final.usage.output_tokens == 8
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert client.messages.count_tokens(model="tiny", messages=USER, system="Be brief.") \
        .input_tokens == plain.usage.input_tokens


def test_recorded_ids_are_exactly_the_sampled_ones_and_two_calls_make_one_sequence(live):
    running, client = live
    server = running.server
    header = {"X-TurnRL-Episode": "msg-1"}
    first = client.messages.create(model="tiny", max_tokens=6, messages=USER,
                                   extra_headers=header)
    history = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                        for b in first.content]},
                      {"role": "user", "content": [{"type": "text", "text": "Another."}]}]
    with client.messages.stream(model="tiny", max_tokens=6, messages=history,
                                extra_body={"turnrl_episode": "msg-1"}) as stream:
        second = stream.get_final_message()
    recorded = server.recorder.episodes["msg-1"]
    assert recorded.calls == 2 and len(recorded.segments) == 1  # the second extends the first
    segment = recorded.segments[0]
    replies = [segment.token_ids[s:e] for s, e in segment.spans]
    deadline = time.monotonic() + 10  # a streamed reply ends before the engine call returns
    while replies[1] not in server.engine.sampled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(r in server.engine.sampled for r in replies)  # token for token what it sampled
    for reply, ids in zip([first, second], replies, strict=True):
        shown = ids[:-1] if ids[-1] == server.chat.end_of_turn else ids
        assert server.tokenizer.decode(shown) == "".join(b.text for b in reply.content)
    policy = {i for s, e in segment.spans for i in range(s, e)}
    assert [i for i, m in enumerate(segment.loss_mask) if m] == sorted(policy)


def test_tool_use_and_tool_result_blocks_round_trip_into_one_sequence():
    server = scripted(["Let me add.\n" + CALL, "It is 5."])
    with RunningServer(server) as running:
        client = client_of(running)
        history = [{"role": "user", "content": "Add 2 and 3."}]
        first = client.messages.create(model="tiny", max_tokens=200, messages=history,
                                       tools=[ADD], extra_headers={"X-TurnRL-Episode": "t"})
        text, use = first.content
        assert (text.type, text.text, first.stop_reason) == ("text", "Let me add.", "tool_use")
        assert (use.type, use.name, use.input) == ("tool_use", "add", {"a": 2, "b": 3})
        history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                      for b in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": "5"}]}]
        with client.messages.stream(model="tiny", max_tokens=200, messages=history,
                                    tools=[ADD], extra_headers={"X-TurnRL-Episode": "t"}) as s:
            last = s.get_final_message()
        assert last.content[0].text == "It is 5." and last.stop_reason == "end_turn"
        # streamed, a call arrives as a tool_use block with its input as JSON deltas
        with client.messages.stream(model="tiny", max_tokens=200, tools=[ADD],
                                    messages=history[:1]) as s:
            kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s]
            streamed = s.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds
    assert streamed.content[1].input == {"a": 2, "b": 3} and streamed.stop_reason == "tool_use"
    (segment,) = server.recorder.episodes["t"].segments  # both calls: one sequence
    trained = server.tokenizer.decode([t for t, m in zip(segment.token_ids, segment.loss_mask,
                                                         strict=True) if m])
    assert trained == f"Let me add.\n{CALL}<|im_end|>It is 5.<|im_end|>"
    assert '"content": "5"' in server.tokenizer.decode(segment.token_ids)  # the tool result


def test_stop_sequences_and_max_tokens_give_their_stop_reasons():
    with RunningServer(scripted(["It is 9. Done."])) as running:
        client = client_of(running)
        cut = client.messages.create(model="tiny", max_tokens=50, messages=USER,
                                     stop_sequences=["Done", "9."])
        assert (cut.content[0].text, cut.stop_reason, cut.stop_sequence) == (
            "It is ", "stop_sequence", "9.")
        short = client.messages.create(model="tiny", max_tokens=3, messages=USER)
        assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
        whole = client.messages.create(model="tiny", max_tokens=50, messages=USER)
        assert whole.content[0].text == "It is 9. Done." and whole.stop_reason == "end_turn"
        with client.messages.stream(model="tiny", max_tokens=50, messages=USER,
                                    stop_sequences=["Done"]) as s:
            final = s.get_final_message()
        assert (final.content[0].text, final.stop_sequence) == ("It is 9. ", "Done")


BAD = [  # (body change, status, a phrase of the message)
    ({"max_tokens": None}, 400, "'max_tokens' is required"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "top-level 'system'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "'image' block is not supported"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     400, "prefill"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, 400,
     "tool_use_id"),
    ({"tools": [{"name": "add"}]}, 400, "input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "server tools"),
    ({"tools": [ADD], "tool_choice": {"type": "tool", "name": "mul"}}, 400, "not among"),
    ({"tool_choice": {"type": "any"}}, 400, "no 'tools'"),
    ({"temperature": 1.5}, 400, "'temperature' must be a number in [0, 1]"),
    ({"top_k": 5}, 400, "top_k"),
    ({"stop_sequences": "x"}, 400, "stop_sequences"),
    ({"model": "claude-opus"}, 404, "serve.model_name"),
    ({"messages": [{"role": "user", "content": "x" * 1100}]}, 400, "context"),
]


@pytest.mark.parametrize("change,status,phrase", BAD)
def test_bad_requests_get_anthropics_error_shape_and_a_4xx(live, change, status, phrase):
    running, _ = live
    body = {"model": "tiny", "max_tokens": 4, "messages": USER, **change}
    got, answer = post(f"{running.base_url}/messages", json.dumps(body).encode())
    assert got == status and answer["type"] == "error", answer
    assert answer["error"]["type"] == ("not_found_error" if status == 404
                                       else "invalid_request_error")
    assert phrase in answer["error"]["message"]


def test_the_client_raises_its_own_errors_and_chat_completions_keep_openais_shape(live):
    running, client = live
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-opus", max_tokens=4, messages=USER)
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=4, messages=[])
    got, answer = post(f"{running.base_url}/messages", b"{not json")
    assert got == 400 and "JSON" in answer["error"]["message"] and answer["type"] == "error"
    got, answer = post(f"{running.base_url}/chat/completions", b"{not json")
    assert got == 400 and "type" not in answer and "JSON" in answer["error"]["message"]


def test_x_api_key_and_bearer_are_both_accepted():
    with RunningServer(scripted(["Hi."], api_key="s3cret")) as running:
        with pytest.raises(anthropic.AuthenticationError) as err:
            client_of(running, key="wrong").messages.create(model="tiny", max_tokens=4,
                                                            messages=USER)
        assert err.value.body["error"]["type"] == "authentication_error"
        ok = client_of(running, key="s3cret").messages.create(model="tiny", max_tokens=4,
                                                              messages=USER)
        assert ok.content[0].text == "Hi."
        bearer = Anthropic(base_url=running.base_url.removesuffix("/v1"), auth_token="s3cret",
                           max_retries=0)
        assert bearer.messages.create(model="tiny", max_tokens=4, messages=USER).content


def test_a_dropped_stream_leaves_the_whole_reply_recorded_not_half():
    reply = "One two three four five six seven eight nine ten."
    server = scripted([reply])
    with RunningServer(server) as running:
        body = json.dumps({"model": "tiny", "max_tokens": 100, "messages": USER, "stream": True,
                           "turnrl_episode": "gone"}).encode()
        with socket.create_connection(("127.0.0.1", running.port), timeout=30) as leaving:
            leaving.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: "
                            b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                            % (len(body), body))
            seen = b""
            while b"event: message_start" not in seen:  # the headers may come alone first
                chunk = leaving.recv(65536)
                assert chunk, seen
                seen += chunk
        deadline = time.monotonic() + 30
        while server.engine.calls < 1 or messages._replies:  # generation goes on, then ends
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (segment,) = server.recorder.episodes["gone"].segments
        start, end = segment.spans[0]
        assert server.tokenizer.decode(segment.token_ids[start:end]) == reply + "<|im_end|>"


def test_chat_messages_and_tools_convert_blocks_in_order():
    out = chat_messages("S", [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                    "text": "b"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "f",
                                           "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                      "content": [{"type": "text", "text": "boom"}],
                                      "is_error": True}, {"type": "text", "text": "go"}]}])
    assert out == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f",
                                                          "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Error: boom"},
        {"role": "user", "content": "go"}]
    tools, choice = chat_tools([ADD], {"type": "tool", "name": "add"})
    assert tools[0]["function"]["parameters"] == ADD["input_schema"]
    assert choice == {"type": "function", "function": {"name": "add"}}
    assert chat_tools([ADD], {"type": "any"})[1] == "required"
    assert chat_tools(None, None) == (None, "auto")


async def harness(claude: AsyncAnthropic, task: str) -> str:
    """Agent code that knows only the Messages API: two turns, the second extending the
    first."""
    history = [{"role": "user", "content": task}]
    first = await claude.messages.create(model="tiny", max_tokens=4, messages=history)
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                  for b in first.content]},
                {"role": "user", "content": "Once more."}]
    second = await claude.messages.create(model="tiny", max_tokens=4, messages=history)
    return "".join(b.text for m in (first, second) for b in m.content if b.type == "text")


def test_an_agent_on_the_messages_api_trains_through_train_agent(tmp_path):
    cfg = load_config(None, [
        "--model.name", "tiny", "--run.out_dir", str(tmp_path / "run"), "--run.steps", "2",
        "--rollout.group_size", "4", "--rollout.groups_per_step", "1", "--serve.port", "0",
        "--run.progress", "false", "--optim.lr", "1e-2", "--run.tensorboard", "false"])

    async def rollout(client, task) -> float:
        env = anthropic_env(client)  # only the base URL (naming the episode) and the key
        async with AsyncAnthropic(base_url=env["ANTHROPIC_BASE_URL"], max_retries=0,
                                  api_key=env["ANTHROPIC_API_KEY"]) as claude:
            text = await harness(claude, task)
        return float(any(c.isdigit() for c in text)) + len(text) / 100

    before = {k: v.clone() for k, v in tiny_model(seed=0)[0].state_dict().items()}
    result = train_agent(rollout, ["Say a digit."], cfg)
    assert len(result.rewards) == 2 and not result.left_out
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert lines[0]["episode/segments"] == 4 and lines[0]["episode/turns"] == 2  # merged
    from safetensors.torch import load_file
    after = load_file(str(tmp_path / "run" / "checkpoints" / "step-000002" /
                          "model.safetensors"))
    assert any(not torch.equal(after[k], before[k]) for k in after if k in before)


def test_a_harness_that_only_reads_its_environment_is_recorded_into_the_episode():
    """A separate process whose code is plain ``anthropic.Anthropic()`` (base URL and key
    from the environment, as Claude Code takes them) is served and recorded."""
    from openai import AsyncOpenAI

    harness_code = ("import anthropic; print(anthropic.Anthropic(max_retries=0).messages.create("
                    "model='tiny', max_tokens=50, messages=[{'role': 'user', 'content': 'Hi'}])"
                    ".content[0].text)")
    server = scripted(["Hello there."], api_key="k3y")
    with RunningServer(server) as running:
        client = AsyncOpenAI(base_url=running.base_url, api_key="k3y",
                             default_headers={"X-TurnRL-Episode": "sub-1"})
        env = anthropic_env(client)
        assert env == {"ANTHROPIC_BASE_URL": f"{running.base_url}/turnrl/episodes/sub-1",
                       "ANTHROPIC_API_KEY": "k3y"}
        done = subprocess.run([sys.executable, "-c", harness_code], capture_output=True,
                              text=True, timeout=120, env={**os.environ, **env})
        assert done.returncode == 0 and done.stdout == "Hello there.\n", done.stderr[-2000:]
        got, answer = post(f"{env['ANTHROPIC_BASE_URL']}/v1/messages", b"{}")  # no key sent
        assert got == 401 and answer["error"]["type"] == "authentication_error"
        asyncio.run(client.close())
    (segment,) = server.recorder.episodes["sub-1"].segments
    start, end = segment.spans[0]
    assert server.tokenizer.decode(segment.token_ids[start:end]) == "Hello there.<|im_end|>"
    assert anthropic_env(OpenAI(base_url="http://h:1/v1", api_key="x")) == {
        "ANTHROPIC_BASE_URL": "http://h:1", "ANTHROPIC_API_KEY": "x"}  # no episode: the root


class FailingEngine:
    version = 0

    def generate(self, prompts, params, on_step=None):
        raise RuntimeError("the engine broke")


def test_an_engine_failure_is_an_api_error_in_anthropics_shape_streamed_or_not():
    server = scripted(["unused"])
    server.engine = server.batcher.engine = FailingEngine()
    with RunningServer(server) as running:
        client = client_of(running, default_headers={"X-TurnRL-Episode": "broken"})
        with pytest.raises(anthropic.InternalServerError) as err:
            client.messages.create(model="tiny", max_tokens=4, messages=USER)
        assert err.value.body["error"] == {"type": "api_error",
                                           "message": "RuntimeError: the engine broke"}
        with pytest.raises(anthropic.APIStatusError) as err:  # the stream had begun: 200
            with client.messages.stream(model="tiny", max_tokens=4, messages=USER) as stream:
                list(stream)
        assert err.value.body["error"]["type"] == "api_error"
    assert not server.recorder.episodes  # nothing sampled, nothing recorded


def send(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


GOOD = {"model": "tiny", "max_tokens": 3, "system": "S", "tools": [ADD], "messages": [
    {"role": "user", "content": "Add."},
    {"role": "assistant", "content": [{"type": "text", "text": "ok"}, {
        "type": "tool_use", "id": "c1", "name": "add", "input": {"a": 1, "b": 2}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "3"}]}]}
PLACES = {  # where a field is replaced: (path into GOOD, fields)
    (): ["model", "max_tokens", "messages", "system", "tools", "tool_choice", "temperature",
         "top_p", "stop_sequences", "stream", "turnrl_episode", "metadata"],
    ("messages", 1): ["role", "content"],
    ("messages", 1, "content", 1): ["type", "id", "name", "input"],
    ("messages", 2, "content", 0): ["type", "tool_use_id", "content", "is_error"],
    ("tools", 0): ["type", "name", "input_schema"],
}


@pytest.mark.parametrize("seed", range(3))
def test_malformed_fields_get_a_4xx_in_anthropics_shape_never_a_500(live, seed):
    from tests.serve.test_http_fuzz import VALUES

    running, _ = live
    rng = random.Random(seed)
    for path, fields in PLACES.items():
        for field in fields:
            body = json.loads(json.dumps(GOOD))
            node = body
            for key in path:
                node = node[key]
            node[field] = rng.choice(VALUES)
            status, raw = send(f"{running.base_url}/messages", body)
            if status == 200:
                continue  # a value the API takes (a reply, streamed or not)
            answer = json.loads(raw)
            assert status in (400, 404) and answer["type"] == "error", (body, status, raw)
            message = answer["error"]["message"]
            assert message and "\n" not in message and "Traceback" not in message
