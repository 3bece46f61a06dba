"""Recording served calls: merging into one multi-turn sequence, segments on a history rewrite,
rewards, and tool calls through the live endpoint (pure functions first)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from openai import OpenAI

from turnrl.config import ServeConfig
from turnrl.models import tiny_tokenizer
from turnrl.rollout import ChatFormat
from turnrl.samplers import Completion
from turnrl.serve import (
    Call,
    RecordedEpisode,
    Recorder,
    Segment,
    Server,
    merge_call,
    prompt_ids,
    training_episodes,
)
from turnrl.serve.agents import play_groups, self_judge
from turnrl.serve.app import RunningServer
from turnrl.serve.batcher import cut_to
from turnrl.serve.judge import judge_messages, parse_scores
from turnrl.serve.prompt import split_reply
from turnrl.serve.server import cut_at_stop
from turnrl.types import ENV_VERSION


def call(prompt, sampled, version=0, text=""):
    return Call(list(prompt), text, list(sampled), [-0.1 * (i + 1) for i in range(len(sampled))],
                version, "")


def test_a_call_that_extends_merges_with_masks_and_versions():
    segments: list[Segment] = []
    assert merge_call(segments, call([1, 2, 3], [4, 5], version=0)) == 0
    assert merge_call(segments, call([1, 2, 3, 4, 5, 6, 7], [8], version=1)) == 0
    (s,) = segments
    assert s.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert s.versions == [ENV_VERSION] * 3 + [0, 0] + [ENV_VERSION] * 2 + [1]
    assert s.logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.1])
    assert s.spans == [(3, 5), (7, 8)]


def test_a_history_rewrite_starts_a_segment_and_a_branch_extends_the_longest():
    segments: list[Segment] = []
    merge_call(segments, call([1, 2, 3], [4]))
    assert merge_call(segments, call([1, 2, 9, 9], [5])) == 1  # the agent edited turn one
    assert merge_call(segments, call([1, 2, 3, 4, 6], [7])) == 0  # continues the first again
    assert merge_call(segments, call([1, 2, 9, 9, 5, 0], [8])) == 1
    assert [s.token_ids for s in segments] == [[1, 2, 3, 4, 6, 7], [1, 2, 9, 9, 5, 0, 8]]
    assert merge_call(segments, call([1, 2, 3, 4], [5])) == 2  # a prefix is not an extension


def test_prompt_ids_append_only_the_new_text_to_the_sampled_ids():
    encode = lambda text: [ord(c) for c in text]  # noqa: E731 - a character tokenizer
    seg = Segment(token_ids=[1000, 1001], text="ab")  # ids that are not encode("ab")
    assert prompt_ids([seg], "abcd", encode) == [1000, 1001, ord("c"), ord("d")]
    assert prompt_ids([seg], "xbcd", encode) == encode("xbcd")  # rewritten: from scratch
    longer = Segment(token_ids=[7], text="abc")
    assert prompt_ids([seg, longer], "abcd", encode) == [7, ord("d")]


def test_segments_share_the_reward_and_unrewarded_episodes_are_reported(tmp_path):
    recorder = Recorder(str(tmp_path / "rec"))
    recorder.record("a", call([1, 2], [3]))
    recorder.record("a", call([5, 6], [7]))
    recorder.record("b", call([1], [2]))
    assert recorder.unrewarded() == ["a", "b"]
    with pytest.raises(ValueError, match="no reward"):
        training_episodes(recorder.episodes["a"], group=0)
    recorder.set_reward("a", 0.5)
    with pytest.raises(KeyError, match="X-TurnRL-Episode"):
        recorder.set_reward("never", 1.0)
    assert recorder.unrewarded() == ["b"]
    (line,) = (tmp_path / "rec" / "episodes.jsonl").read_text().splitlines()  # serve.record_dir
    saved = json.loads(line)
    assert saved["reward"] == 0.5 and [s["token_ids"] for s in saved["segments"]] == [
        [1, 2, 3], [5, 6, 7]]
    episodes = training_episodes(recorder.episodes["a"], group=4)
    assert [(e.reward, e.group, e.token_ids) for e in episodes] == [(0.5, 4, [1, 2, 3]),
                                                                   (0.5, 4, [5, 6, 7])]
    assert [e.info["segment"] for e in episodes] == [0, 1]
    assert isinstance(recorder.take(["a", "zz"])[0], RecordedEpisode) and "a" not in \
        recorder.episodes


def test_reply_shaping_stop_strings_calls_and_limits():
    text_of = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    ids = [ord(c) for c in "hello world"]
    assert cut_at_stop(text_of, ids, ("o w", "zz")) == (7, 4)  # tokens to "o w"; text "hell"
    assert cut_at_stop(text_of, ids, ("zz",)) is None
    content, calls = split_reply('Let me add.\n<tool_call>\n{"name": "add", "arguments": '
                                 '{"a": 2, "b": 3}}\n</tool_call>', "hermes")
    assert content == "Let me add." and calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert split_reply("<tool_call>{bad json}</tool_call>", "hermes")[1] == []
    assert cut_to(Completion([1, 2, 3], [0.1, 0.2, 0.3], "stop"), 2).finish_reason == "length"


class ScriptedEngine:
    """Replies with fixed texts: the tiny random model cannot write a tool call."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.version, self.calls = tokenizer, replies, 0, 0

    def generate(self, prompts, params):
        text = self.replies[self.calls % len(self.replies)]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [
            self.tokenizer.eos_token_id]
        return [Completion(list(ids), [-0.5] * len(ids), "stop") for _ in prompts]


ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {
                                            "a": {"type": "integer"},
                                            "b": {"type": "integer"}},
                                            "required": ["a", "b"]}}}


def test_tool_calls_through_the_endpoint_and_back_in_one_sequence():
    tokenizer = tiny_tokenizer()
    chat = ChatFormat(tokenizer)
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, [call_text, "It is 5."])
    server = Server(torch.nn.Linear(1, 1), chat, engine, name="tiny", max_context=1024,
                    cfg=ServeConfig(max_tokens=128))
    with RunningServer(server) as running:
        client = OpenAI(base_url=running.base_url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        first = client.chat.completions.create(model="tiny", messages=messages, tools=[ADD],
                                               extra_body={"turnrl_episode": "t"})
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (tool_call,) = choice.message.tool_calls
        assert tool_call.function.name == "add"
        assert json.loads(tool_call.function.arguments) == {"a": 2, "b": 3}
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tool_call.id, "content": "5"}]
        second = client.chat.completions.create(model="tiny", messages=messages, tools=[ADD],
                                                extra_body={"turnrl_episode": "t"})
        assert second.choices[0].message.content == "It is 5."
        assert running.server.recorder.unrewarded() == ["t"]
        assert client.post("/turnrl/episodes/t/reward", body={"reward": 1.0},
                           cast_to=object)["segments"] == 1
    (segment,) = server.recorder.episodes["t"].segments
    text = tokenizer.decode(segment.token_ids)
    # SmolLM2-like templates render no tools: the fallback prompt teaches the format, and the
    # result comes back as a <tool_response> user turn after the call the model wrote.
    assert '"name": "add"' in text.split("<|im_start|>user")[0]
    assert call_text + "<|im_end|>" in text
    assert '<tool_response>\n{"name": "add", "content": "5"}\n</tool_response>' in text
    assert server.recorder.episodes["t"].reward == 1.0


def test_parse_scores_takes_only_a_well_formed_answer():
    assert parse_scores('Sure. {"scores": [3, 9.5]}', 2) == [0.3, 0.95]
    assert parse_scores('{"scores": [3]}', 2) is None  # one score for two attempts
    assert parse_scores('{"scores": [3, 11]}', 2) is None  # out of range
    assert parse_scores("3 and 9", 2) is None
    prompt = judge_messages("Add 2 and 3.", ["five", "5"])[1]["content"]
    assert "<attempt 2>\n5\n</attempt 2>" in prompt and "Add 2 and 3." in prompt


def test_a_judge_scores_a_group_relative_and_a_silent_judge_trains_nothing():
    tokenizer = tiny_tokenizer()
    engine = ScriptedEngine(tokenizer, ['{"scores": [2, 8]}'])
    server = Server(torch.nn.Linear(1, 1), ChatFormat(tokenizer), engine, name="tiny",
                    max_context=1024, cfg=ServeConfig(max_tokens=64))

    async def rollout(client, task):  # no verifiable reward: None
        await client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": task}])

    with RunningServer(server) as running:
        judge = self_judge(running.base_url, "tiny")
        episodes, left_out = asyncio.run(play_groups(server, running.base_url, rollout, ["Q"], 2,
                                                     0, 1.0, judge))
        assert sorted(e.reward for e in episodes) == [0.2, 0.8] and not left_out
        engine.replies = ["no idea"]
        episodes, left_out = asyncio.run(play_groups(server, running.base_url, rollout, ["Q"], 2,
                                                     1, 1.0, judge))
        assert not episodes and {x["reason"] for x in left_out} == {"the judge gave no scores"}
        assert not server.recorder.episodes  # taken, none left behind
