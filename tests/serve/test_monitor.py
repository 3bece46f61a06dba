"""``/health`` and ``/metrics`` on a live tiny server: no key needed, and the numbers, read
by the official Prometheus parser, match what the requests did."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import torch
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.test_serve import USER, tiny_server
from turnrl.prometheus import CONTENT_TYPE
from turnrl.samplers import SamplingParams
from turnrl.serve.app import RunningServer

KEY = "sekrit"


def get(url: str, key: str | None = None) -> tuple[int, str, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"}
                                     if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers["content-type"], response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["content-type"], err.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} as prometheus_client parses the exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def keyed():
    torch.set_num_threads(2)
    with RunningServer(tiny_server(api_key=KEY)) as running:
        yield running, running.base_url.removesuffix("/v1")


def test_health_and_metrics_need_no_key_while_v1_does(keyed):
    running, root = keyed
    status, kind, body = get(f"{root}/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert json.loads(body)["policy_version"] == running.server.engine.version
    status, kind, body = get(f"{root}/metrics")
    assert status == 200 and kind == CONTENT_TYPE
    assert ("turnrl_queue_depth", ()) in samples(body)
    assert get(f"{root}/v1/models")[0] == 401
    assert get(f"{root}/v1/models", KEY)[0] == 200


def test_metrics_count_what_the_requests_did(keyed):
    running, root = keyed
    before = samples(get(f"{root}/metrics")[2])
    client = OpenAI(base_url=running.base_url, api_key=KEY, max_retries=0)
    pair = client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, n=2)
    one = client.chat.completions.create(model="tiny", messages=USER, max_tokens=5,
                                         extra_headers={"X-TurnRL-Episode": "mon-1"})
    get(f"{root}/v1/turnrl/episodes/mon-1")  # no key: 401, counted under its route
    after = samples(get(f"{root}/metrics")[2])

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("turnrl_completions_total") == 2 and grew("turnrl_choices_total") == 3
    assert grew("turnrl_prompt_tokens_total") == pair.usage.prompt_tokens + one.usage.prompt_tokens
    assert grew("turnrl_completion_tokens_total") == (pair.usage.completion_tokens
                                                      + one.usage.completion_tokens)
    assert grew("turnrl_episodes_recorded_total") == 1
    assert grew("turnrl_recorded_calls_total") == 1
    assert after[("turnrl_episodes_unrewarded", ())] >= 1
    assert grew("turnrl_engine_calls_total") >= 1
    assert grew("turnrl_http_requests_total", route="/v1/chat/completions", method="POST",
                status="200") == 2
    assert grew("turnrl_http_requests_total", route="/v1/turnrl/episodes/{episode_id}",
                method="GET", status="401") == 1
    assert grew("turnrl_http_request_duration_seconds_count",
                route="/v1/chat/completions") == 2
    assert grew("turnrl_http_request_duration_seconds_sum", route="/v1/chat/completions") > 0
    assert after[("turnrl_queue_depth", ())] == 0


def test_queue_depth_counts_choices_waiting_for_the_engine():
    async def main() -> int:
        batcher = tiny_server().batcher  # its loop is not running: requests stay queued
        asks = [asyncio.create_task(batcher.generate([1, 2], SamplingParams(4, 1.0, 1.0), n))
                for n in (2, 3)]
        await asyncio.sleep(0)
        waiting = batcher.waiting
        asks[0].cancel()
        await asyncio.sleep(0)
        waiting_after_cancel = batcher.waiting
        asks[1].cancel()
        return waiting, waiting_after_cancel

    assert asyncio.run(main()) == (5, 3)
