"""The Responses API of ``turnrl serve`` (``POST /v1/responses``), driven by the official
``openai`` client's ``responses.create`` / ``responses.stream`` against live servers: the tiny
model for exact recording (the recorded ids are the ones the engine sampled, chained calls
merge into the one sequence training consumes), a scripted engine for function calls, bad
requests as OpenAI's 4xx errors, a dropped stream recorded whole, and ``train_agent``
training a Responses agent unchanged."""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from openai import OpenAI

from tests.serve.test_stream import CALL, scripted
from turnrl.config import ServeConfig, load_config
from turnrl.models import tiny_model
from turnrl.rollout import ChatFormat
from turnrl.samplers import HFEngine
from turnrl.serve import Server, training_episodes
from turnrl.serve.app import RunningServer
from turnrl.serve.responses import chat_tool_choice, chat_tools, input_messages
from turnrl.serve.train import train_agent
from turnrl.types import ENV_VERSION

ADD = {"type": "function", "name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                       "b": {"type": "integer"}},
                      "required": ["a", "b"]}}


class SpyEngine(HFEngine):
    """The tiny model's engine, keeping every prompt it was fed and every completion."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fed, self.sampled = [], []

    def generate(self, prompts, params, on_step=None):
        out = super().generate(prompts, params, on_step=on_step)
        self.fed += [list(p) for p in prompts]
        self.sampled += [list(c.token_ids) for c in out]
        return out

    def settled(self, fed: int, sampled: int, calls: int) -> tuple[list, list]:
        """The prompts and completions of the ``calls`` calls after the first ``fed`` /
        ``sampled``, once their generate returned (a request is answered at its last token,
        a moment before)."""
        deadline = time.monotonic() + 10
        while len(self.sampled) < sampled + calls and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.fed[fed:], self.sampled[sampled:]


@pytest.fixture(scope="module")
def live():
    torch.set_num_threads(2)
    model, tokenizer = tiny_model(seed=0)
    server = Server(model, ChatFormat(tokenizer), SpyEngine(model, tokenizer.pad_token_id, seed=0),
                    name="tiny", max_context=model.config.max_position_embeddings,
                    cfg=ServeConfig(max_tokens=10))
    with RunningServer(server) as running:
        yield running, OpenAI(base_url=running.base_url, api_key="unused", max_retries=0)


# ---- Responses' shapes -> chat messages (pure) -------------------------------------------


def test_input_items_become_chat_messages_with_calls_results_and_reasoning():
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    items = [{"role": "developer", "content": "Be exact."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "2 + "}, {"type": "input_text",
                                                                   "text": "3?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text",
                                                              "text": "Use the tool."}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Adding.", "annotations": []}]},
             {"type": "function_call", "call_id": "c1", "name": "add",
              "arguments": '{"a": 2, "b": 3}'},
             {"type": "function_call_output", "call_id": "c1", "output": "5"},
             {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"}]
    assert input_messages(items) == [
        {"role": "developer", "content": "Be exact."},
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "<think>\nUse the tool.\n</think>\n\nAdding.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {
             "name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                                "text": "Hmm."}]}
    assert input_messages([thought, {"role": "user", "content": "Go on."}]) == [
        {"role": "assistant", "content": "<think>\nHmm.\n</think>\n\n"},
        {"role": "user", "content": "Go on."}]
    (tool,) = chat_tools([ADD])
    assert tool["function"]["name"] == "add" and tool["function"]["parameters"] == \
        ADD["parameters"]
    assert chat_tool_choice({"type": "function", "name": "add"}, [tool]) == {
        "type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize("items, phrase", [
    ([{"type": "input_image", "image_url": "x"}], "input[0]: items of type 'input_image'"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
     "only text parts"),
    ([{"role": "tool", "content": "x"}], "input[0].role must be"),
    ([{"type": "function_call", "name": "add"}], "needs string 'call_id'"),
    ([{"type": "function_call_output", "call_id": "c"}], "needs 'call_id' and 'output'"),
    (7, "'input' must be a string or a list"),
])
def test_bad_input_items_are_named(items, phrase):
    with pytest.raises(Exception) as caught:
        input_messages(items)
    assert caught.value.status == 400 and phrase in caught.value.message


# ---- the tiny model: exact recording, chaining, streaming ---------------------------------


def test_chained_responses_record_the_sampled_ids_in_one_training_sequence(live):
    running, client = live
    server, engine = running.server, running.server.engine
    fed, sampled = len(engine.fed), len(engine.sampled)
    first = client.responses.create(model="tiny", input="Say a digit.", instructions="Be brief.",
                                    extra_headers={"X-TurnRL-Episode": "resp-1"})
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.status in ("completed", "incomplete") and first.output[0].type == "message"
    # No episode id on the second call: it continues the first's, through previous_response_id.
    second = client.responses.create(model="tiny", input="Another one.", instructions="Be brief.",
                                     previous_response_id=first.id, max_output_tokens=6)
    assert second.previous_response_id == first.id and second.usage.output_tokens <= 6
    prompts, replies = engine.settled(fed, sampled, 2)
    assert prompts[1][:len(prompts[0]) + len(replies[0])] == prompts[0] + replies[0]
    recorded = server.recorder.episodes["resp-1"]
    assert recorded.calls == 2 and len(recorded.segments) == 1
    # What training consumes: the engine's ids exactly, replies with mask 1, the rest 0.
    server.recorder.set_reward("resp-1", 1.0)
    (episode,) = training_episodes(recorded, group=0)
    gap = prompts[1][len(prompts[0]) + len(replies[0]):]
    assert episode.token_ids == prompts[0] + replies[0] + gap + replies[1]
    assert episode.loss_mask == ([0] * len(prompts[0]) + [1] * len(replies[0]) + [0] * len(gap)
                                 + [1] * len(replies[1]))
    assert set(episode.versions) == {ENV_VERSION, engine.version}
    assert [(t.start, t.end) for t in episode.turns] == recorded.segments[0].spans
    for response, reply in zip((first, second), replies, strict=True):
        shown = reply[:-1] if reply[-1] == server.chat.end_of_turn else reply
        assert server.tokenizer.decode(shown) == response.output_text
        assert response.usage.output_tokens == len(reply)
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_a_streamed_response_adds_up_to_the_plain_one(live):
    _, client = live
    ask = dict(model="tiny", input="Tell me a story.", temperature=0, max_output_tokens=10)
    plain = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{plain.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text and text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == text
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_bad_requests_get_openai_errors_with_4xx_statuses(live):
    running, client = live
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="gpt-5", input="x")
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert err.value.body["code"] == "previous_response_not_found"
    cases = {"hosted tools": dict(tools=[{"type": "web_search"}]),
             "structured output": dict(text={"format": {"type": "json_object"}}),
             "temperature": dict(temperature=3), "max_output_tokens": dict(max_output_tokens=0),
             "tool_choice": dict(tool_choice={"type": "function", "name": "add"}),
             "background": dict(background=True), "context": dict(max_output_tokens=1020)}
    for case, extra in cases.items():
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="tiny", input="x", **extra)
        assert "\n" not in err.value.body["message"], case
    # Fields of the wrong type and bodies that are not objects: 4xx, never a 500.
    for body in ([], {"model": "tiny"}, {"model": 3, "input": "x"},
                 {"model": "tiny", "input": [3]}, {"model": "tiny", "input": "x", "tools": {}},
                 {"model": "tiny", "input": "x", "instructions": []},
                 {"model": "tiny", "input": "x", "metadata": "m"},
                 {"model": "tiny", "input": "x", "turnrl_episode": 5},
                 {"model": "tiny", "input": "x", "text": "plain"},
                 {"model": "tiny", "input": [{"type": "reasoning", "summary": "s"}]},
                 {"model": "tiny", "input": [{"role": "user", "content": None}]}):
        status, answer = post(f"{running.base_url}/responses", body)
        assert status == 400 and answer["error"]["message"], (body, status, answer)
    assert client.responses.create(model="tiny", input="x", max_output_tokens=2).output


VALUES = [None, 0, -1, 3, 1e308, 10 ** 30, "", "x", "tiny", [], [1], ["a", 2], {}, {"a": []},
          True, False, [{"role": "user"}], [{"type": "message"}], {"type": "function"},
          [{"type": "function", "name": "f", "parameters": "x"}], {"format": 3}]
FUZZED = {"model": "tiny", "max_output_tokens": 1, "input": [
    {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "t"}]},
    {"type": "function_call", "call_id": "c", "name": "add", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c", "output": "1"}]}
FIELDS = ["model", "input", "instructions", "tools", "tool_choice", "temperature", "top_p",
          "max_output_tokens", "stream", "store", "previous_response_id", "metadata", "text",
          "turnrl_episode", "background"]
ITEM_FIELDS = ["type", "role", "content", "summary", "call_id", "name", "arguments", "output"]


def test_fields_of_any_type_get_a_response_or_a_one_line_4xx(live):
    running, _ = live
    rng = random.Random(0)
    bodies = []
    for field in FIELDS:
        bodies += [{**FUZZED, field: value} for value in rng.sample(VALUES, 3)]
    for k, item in enumerate(FUZZED["input"]):
        for field in ITEM_FIELDS:
            value = rng.choice(VALUES)
            items = [dict(x) for x in FUZZED["input"]]
            items[k] = {**item, field: value}
            bodies.append({**FUZZED, "input": items})
    for body in bodies:
        status, answer = post(f"{running.base_url}/responses", body)
        assert status in (200, 400, 404), (body, status, answer)
        if status != 200:
            message = answer["error"]["message"]
            assert message and "\n" not in message and "Traceback" not in message, body


def post(url: str, body) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            data = response.read()  # events, when the body asked for a stream
            return response.status, json.loads(data) if data.startswith(b"{") else {}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


# ---- function calls (a scripted engine: the tiny random model cannot write one) -----------


def test_function_calls_round_trip_into_one_sequence_chained_and_stateless():
    server = scripted(["Let me add.\n" + CALL, "It is 5."])
    server.engine.step_s = 0.0
    tokenizer = server.tokenizer
    with RunningServer(server) as running:
        client = OpenAI(base_url=running.base_url, api_key="x", max_retries=0)
        ask = dict(model="tiny", tools=[ADD], instructions="Use the tools.")
        with client.responses.stream(input="What is 2 + 3?", **ask,
                                     extra_body={"turnrl_episode": "chained"}) as stream:
            first = stream.get_final_response()
        message, call = first.output
        assert message.content[0].text == "Let me add." and first.status == "completed"
        assert call.type == "function_call" and call.name == "add"
        assert json.loads(call.arguments) == {"a": 2, "b": 3}
        second = client.responses.create(previous_response_id=first.id, **ask, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
        assert second.output_text == "It is 5." and second.status == "completed"
        # Stateless, as Codex sends it: the whole history each time, store=false.
        history = [{"role": "user", "content": "What is 2 + 3?"}]
        third = client.responses.create(input=history, store=False, **ask,
                                        extra_body={"turnrl_episode": "stateless"})
        history += [item.model_dump(exclude_none=True) for item in third.output]
        history.append({"type": "function_call_output", "call_id": third.output[1].call_id,
                        "output": "5"})
        assert client.responses.create(input=history, store=False, **ask,
                                       extra_body={"turnrl_episode": "stateless"}
                                       ).output_text == "It is 5."
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(third.id)
    for name in ("chained", "stateless"):
        recorded = server.recorder.episodes[name]
        (segment,) = recorded.segments
        assert recorded.calls == 2
        text = tokenizer.decode(segment.token_ids)
        assert "Let me add.\n" + CALL + "<|im_end|>" in text  # as the model wrote it
        assert '<tool_response>\n{"name": "add", "content": "5"}\n</tool_response>' in text
        trained = tokenizer.decode([t for t, m in zip(segment.token_ids, segment.loss_mask,
                                                      strict=True) if m])
        assert trained == "Let me add.\n" + CALL + "<|im_end|>It is 5.<|im_end|>"


def test_a_forced_call_streams_as_a_function_call_item_only():
    server = scripted(['{"a": 2, "b": 3}}\n</tool_call>'])
    server.engine.step_s = 0.0
    with RunningServer(server) as running:
        client = OpenAI(base_url=running.base_url, api_key="x", max_retries=0)
        events = list(client.responses.create(
            model="tiny", input="Add 2 and 3.", tools=[ADD], stream=True,
            tool_choice={"type": "function", "name": "add"}))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    (call,) = events[-1].response.output
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 2, "b": 3})
    assert events[2].item.arguments == "" and events[3].delta == call.arguments


def test_an_engine_failure_is_a_failed_event_in_a_stream_and_a_500_otherwise():
    server = scripted(["never"])

    def broken(prompts, params, on_step=None):
        raise RuntimeError("engine down")

    server.engine.generate = broken
    with RunningServer(server) as running:
        client = OpenAI(base_url=running.base_url, api_key="x", max_retries=0)
        *_, last = client.responses.create(model="tiny", input="Hi", stream=True)
        assert last.type == "response.failed" and last.response.status == "failed"
        assert last.response.error.message == "RuntimeError: engine down"
        with pytest.raises(openai.InternalServerError):
            client.responses.create(model="tiny", input="Hi")


def test_a_dropped_stream_is_recorded_whole_and_stored():
    reply = "One two three four five six seven eight nine ten eleven twelve."
    server = scripted([reply])
    server.engine.step_s = 0.05
    with RunningServer(server) as running:
        client = OpenAI(base_url=running.base_url, api_key="x", max_retries=0)
        stream = client.responses.create(model="tiny", input="Count.", stream=True,
                                         extra_headers={"X-TurnRL-Episode": "dropped"})
        for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            if event.type == "response.output_text.delta":
                break
        stream.close()  # gone mid-reply
        dropped_at = time.monotonic()
        while not server.recorder.episodes and time.monotonic() - dropped_at < 30:
            time.sleep(0.05)
        assert time.monotonic() - dropped_at > 0.5  # the reply went on after the client left
        stored = client.responses.retrieve(response_id)
        assert stored.status == "completed" and stored.output_text == reply
    (segment,) = server.recorder.episodes["dropped"].segments
    (start, end), = segment.spans
    ids = server.tokenizer(reply, add_special_tokens=False)["input_ids"]
    assert segment.token_ids[start:end] == ids + [server.tokenizer.eos_token_id]


# ---- training a Responses agent -------------------------------------------------------------


async def responses_agent(client, task) -> float:
    """Two chained calls per episode; reward: a digit in the replies, plus length / 100."""
    first = await client.responses.create(model="tiny", input=task, max_output_tokens=4)
    second = await client.responses.create(model="tiny", input="Once more.",
                                           previous_response_id=first.id, max_output_tokens=4)
    text = first.output_text + second.output_text
    return float(any(c.isdigit() for c in text)) + len(text) / 100


def test_train_agent_trains_a_responses_agent_unchanged(tmp_path):
    cfg = load_config(None, [
        "--model.name", "tiny", "--run.out_dir", str(tmp_path / "run"), "--run.steps", "1",
        "--rollout.group_size", "2", "--rollout.groups_per_step", "2", "--serve.port", "0",
        "--run.progress", "false", "--optim.lr", "1e-2", "--run.tensorboard", "false"])
    result = train_agent(responses_agent, ["Say a digit.", "Name a number."], cfg)
    assert not result.left_out and len(result.rewards) == 1
    (line,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert line["episode/segments"] == 4 and line["episode/turns"] == 2  # chained: merged
