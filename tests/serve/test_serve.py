"""``turnrl serve`` driven by the official ``openai`` client against a live server on the tiny
model: chat, streaming, n/max_tokens/stop, logprobs, errors, the API key and the bind check."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest
import torch
from openai import OpenAI

from turnrl import cli
from turnrl.config import ServeConfig
from turnrl.models import tiny_model
from turnrl.rollout import ChatFormat
from turnrl.samplers import HFEngine
from turnrl.serve import Server
from turnrl.serve.app import RunningServer

USER = [{"role": "user", "content": "Say a digit."}]


def tiny_server(**cfg) -> Server:
    model, tokenizer = tiny_model(seed=0)
    chat = ChatFormat(tokenizer)
    return Server(model, chat, HFEngine(model, tokenizer.pad_token_id, seed=0), name="tiny",
                  max_context=model.config.max_position_embeddings,
                  cfg=ServeConfig(max_tokens=12, **cfg))


@pytest.fixture(scope="module")
def live():
    torch.set_num_threads(2)
    with RunningServer(tiny_server()) as running:
        yield running, OpenAI(base_url=running.base_url, api_key="unused", max_retries=0)


def test_models_and_a_chat_completion(live):
    running, client = live
    assert [m.id for m in client.models.list().data] == ["tiny"]
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=7)
    assert len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= reply.usage.completion_tokens <= 7
    tokenizer = running.server.tokenizer
    prompt = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)
                                            ["input_ids"])


def test_recorded_ids_are_the_sampled_ones_and_decode_to_the_served_text(live):
    running, client = live
    server = running.server
    first = client.chat.completions.create(model="tiny", messages=USER, logprobs=True,
                                           extra_headers={"X-TurnRL-Episode": "rec-1"})
    history = USER + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "user", "content": "Another one."}]
    second = client.chat.completions.create(model="tiny", messages=history, logprobs=True,
                                            extra_body={"turnrl_episode": "rec-1"})
    recorded = server.recorder.episodes["rec-1"]
    assert recorded.calls == 2 and len(recorded.segments) == 1  # one multi-turn sequence
    segment = recorded.segments[0]
    eot = server.chat.end_of_turn
    for reply, (start, end) in zip([first, second], segment.spans, strict=True):
        ids = segment.token_ids[start:end]
        assert all(segment.loss_mask[start:end]) and ids
        shown = ids[:-1] if ids[-1] == eot else ids
        assert server.tokenizer.decode(shown) == reply.choices[0].message.content
        served = [t.logprob for t in reply.choices[0].logprobs.content]
        assert served == pytest.approx(segment.logprobs[start:start + len(shown)])
    # Everything outside the two replies (prompt, the agent's new turn) is masked out.
    policy = {i for s, e in segment.spans for i in range(s, e)}
    assert [i for i, m in enumerate(segment.loss_mask) if m] == sorted(policy)
    # The ids are what the engine sampled: a fresh forward pass gives their log-probabilities.
    with torch.no_grad():
        logits = server.model(torch.tensor([segment.token_ids])).logits[0].float()
    fresh = torch.log_softmax(logits[:-1], -1).gather(
        -1, torch.tensor(segment.token_ids[1:])[:, None])[:, 0]
    mask = torch.tensor(segment.loss_mask[1:], dtype=torch.bool)
    assert torch.allclose(fresh[mask], torch.tensor(segment.logprobs[1:])[mask], atol=1e-4)
    assert segment.versions[segment.spans[0][0]] == server.engine.version


def test_streaming_gives_the_same_greedy_text(live):
    _, client = live
    plain = client.chat.completions.create(model="tiny", messages=USER, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=USER, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] \
        == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_n_max_tokens_and_stop(live):
    _, client = live
    reply = client.chat.completions.create(model="tiny", messages=USER, n=3, max_tokens=5)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens <= 15
    greedy = client.chat.completions.create(model="tiny", messages=USER, temperature=0,
                                            max_tokens=12).choices[0].message.content
    stop = greedy[4:6]
    cut = client.chat.completions.create(model="tiny", messages=USER, temperature=0,
                                         max_tokens=12, stop=[stop]).choices[0]
    assert cut.message.content == greedy[:greedy.index(stop)] and cut.finish_reason == "stop"


def test_errors_are_openai_shaped_with_the_right_status(live):
    running, client = live
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=USER)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"content": "no role"}])
    assert "role" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                 "content": "x" * 1100}])
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=1020)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=USER, temperature=3)
    with pytest.raises(openai.BadRequestError):  # which of the n choices would be recorded?
        client.chat.completions.create(model="tiny", messages=USER, n=2,
                                       extra_body={"turnrl_episode": "n2"})
    status, body = post(f"{running.base_url}/chat/completions", b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    assert post(f"{running.base_url}/turnrl/episodes/never/reward", b'{"reward": 1}')[0] == 404


def post(url: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_api_key_is_required_when_set():
    with RunningServer(tiny_server(api_key="s3cret")) as running:
        for key in ("wrong", None):
            client = OpenAI(base_url=running.base_url, api_key=key or "x", max_retries=0,
                            default_headers={} if key else {"Authorization": ""})
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        ok = OpenAI(base_url=running.base_url, api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model="tiny", messages=USER, max_tokens=2).choices


def test_a_public_bind_without_a_key_refuses_to_start(capsys):
    assert cli.main(["serve", "--model.name", "tiny", "--serve.host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--serve.api_key" in err and "0.0.0.0" in err


def test_concurrent_requests_share_engine_calls_and_a_slow_agent_blocks_nobody(live):
    running, _ = live
    batcher = running.server.batcher
    calls, rows = batcher.calls, batcher.rows - batcher.continued

    async def agents() -> list[str]:
        from openai import AsyncOpenAI

        order = []
        async with AsyncOpenAI(base_url=running.base_url, api_key="x", max_retries=0) as client:
            async def ask():
                return await client.chat.completions.create(model="tiny", messages=USER,
                                                            max_tokens=4)

            async def slow():  # one call, then a long "tool" (3 s)
                await ask()
                await asyncio.sleep(3.0)
                order.append("slow")

            async def quick():
                for _ in range(3):
                    await ask()
                order.append("quick")

            await asyncio.gather(*(ask() for _ in range(8)))
            order.append(batcher.calls - calls)
            await asyncio.gather(slow(), quick())
        return order

    calls_for_eight, *order = asyncio.run(agents())
    assert batcher.rows - batcher.continued - rows == 8 + 4  # a joined call re-feeds rows
    assert calls_for_eight < 8  # the 8 requests sent together shared engine calls
    assert order == ["quick", "slow"]  # the quick agent finished while the slow one waited
