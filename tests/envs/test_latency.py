"""The ``slow`` wrapper: log-normal latencies, deterministic, real awaits, faithful delegation."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time

import pytest

from turnrl.config import load_config
from turnrl.envs import ENVS, make_env
from turnrl.envs.latency import Slow, lognormal_ms
from turnrl.envs.reference import REFERENCE_POLICIES


def _draws(env: Slow, n: int) -> list[float]:
    return [env.next_latency_ms() for _ in range(n)]


def test_latencies_are_lognormal_with_the_given_median():
    env = make_env("slow", median_ms=500, sigma=1.0, seed=3)
    draws = _draws(env, 20_000)
    assert statistics.median(draws) == pytest.approx(500, rel=0.05)
    logs = [math.log(d) for d in draws]
    assert statistics.fmean(logs) == pytest.approx(math.log(500), abs=0.03)
    assert statistics.pstdev(logs) == pytest.approx(1.0, rel=0.03)
    # heavy tail: the mean is exp(sigma^2 / 2) = 1.65 x the median; 1 in 100 above 10 x
    assert statistics.fmean(draws) == pytest.approx(500 * math.exp(0.5), rel=0.08)
    assert sum(d > 500 * math.exp(2.326) for d in draws) / len(draws) == pytest.approx(0.01,
                                                                                      abs=0.004)
    assert min(draws) > 0


def test_sigma_zero_is_constant_median_zero_is_no_latency_and_max_caps():
    assert set(_draws(make_env("slow", median_ms=40, sigma=0.0), 50)) == {40.0}
    assert set(_draws(make_env("slow", median_ms=0, sigma=1.0), 50)) == {0.0}
    capped = _draws(make_env("slow", median_ms=100, sigma=2.0, max_ms=300), 2000)
    assert max(capped) == 300.0 and statistics.median(capped) == pytest.approx(100, rel=0.15)
    assert lognormal_ms(random.Random(0), 0, 1.0) == 0.0


def test_latencies_are_deterministic_under_seed_and_distinct_per_episode():
    def episode_latencies(seed, episode_seed, stream, turns=6):
        env = make_env("slow", median_ms=100, seed=seed, stream=stream,
                       options={"max_turns": 100})
        asyncio.run(env.reset(episode_seed))
        return _draws(env, turns)

    assert episode_latencies(1, 7, 0) == episode_latencies(1, 7, 0)
    assert episode_latencies(1, 7, 0) != episode_latencies(2, 7, 0)  # latency seed
    assert episode_latencies(1, 7, 0) != episode_latencies(1, 8, 0)  # episode seed
    # Two episodes of one GRPO group share the episode seed but not their delays.
    assert episode_latencies(1, 7, 0) != episode_latencies(1, 7, 1)
    # Without an explicit stream each env gets its own (its creation index).
    a, b = make_env("slow", median_ms=100), make_env("slow", median_ms=100)
    assert b.stream == a.stream + 1


def test_step_really_awaits_so_slow_steps_overlap():
    async def play():
        envs = [make_env("slow", median_ms=500, sigma=0.0) for _ in range(8)]
        for env in envs:
            await env.reset(0)  # no delay: on_reset is off
        start = time.perf_counter()
        await asyncio.gather(*(env.step("5") for env in envs))
        return time.perf_counter() - start

    elapsed = asyncio.run(play())
    # 8 concurrent 500 ms waits take ~500 ms, one after the other 4 s: a bound between the
    # two with seconds of slack for a busy machine (200 ms waits left 0.6 s of it)
    assert 0.49 <= elapsed < 3.0


def test_on_reset_delays_reset_too():
    async def reset_time(on_reset):
        env = make_env("slow", median_ms=500, sigma=0.0, on_reset=on_reset)
        start = time.perf_counter()
        await env.reset(0)
        return time.perf_counter() - start, env.latencies_ms

    assert asyncio.run(reset_time(False))[0] < 0.4  # no 500 ms wait (busy machine: slack)
    elapsed, drawn = asyncio.run(reset_time(True))
    assert elapsed >= 0.49 and drawn == [500.0]


@pytest.mark.parametrize("name", ["guess-number", "maze", "twenty-questions", "wordle"])
def test_delegation_keeps_observations_rewards_and_state_keys(name):
    """The wrapped env plays exactly like the bare one under the scripted reference policy."""
    inner_options = {"size": 3} if name == "maze" else {}

    async def play(env, seed):
        policy = REFERENCE_POLICIES[name]()
        trace = [await env.reset(seed), getattr(env, "system_prompt", None),
                 getattr(env, "state_key", "none")]
        observation = trace[0]
        policy.reset(observation)
        for _ in range(60):
            result = await env.step(policy.act(observation))
            trace.append((result.observation, result.reward, result.done,
                          {k: v for k, v in result.info.items()},
                          getattr(env, "state_key", "none")))
            observation = result.observation
            if result.done:
                break
        return trace

    for seed in range(3):
        bare = asyncio.run(play(make_env(name, **inner_options), seed))
        wrapped_env = make_env("slow", env=name, median_ms=1, sigma=0.5, options=inner_options)
        assert asyncio.run(play(wrapped_env, seed)) == bare
        assert len(wrapped_env.latencies_ms) == len(bare) - 3  # one delay per step
    assert not hasattr(make_env("slow", env="arithmetic"), "state_key")  # absent stays absent


def test_inner_options_pass_through():
    env = make_env("slow", env="guess-number", options={"low": 1, "high": 3, "max_turns": 2})
    assert (env.inner.high, env.max_turns) == (3, 2)
    first = asyncio.run(env.reset(0))
    assert "between 1 and 3" in first


def test_options_from_the_command_line():
    cfg = load_config(None, ["--env.name", "slow", "--env.options.env", "maze",
                             "--env.options.median_ms", "500", "--env.options.sigma", "1.5",
                             "--env.options.options.size", "4"])
    env = make_env(cfg.env.name, **cfg.env.options)
    assert (env.env_name, env.median_ms, env.sigma, env.inner.size) == ("maze", 500, 1.5, 4)


@pytest.mark.parametrize("options, message", [
    ({"median_ms": -1}, "slow: median_ms must be a finite number >= 0, got -1"),
    ({"sigma": "wide"}, "slow: sigma must be a finite number >= 0, got 'wide'"),
    ({"max_ms": float("nan")}, "slow: max_ms must be a finite number >= 0"),
    ({"seed": 1.5}, "slow: seed must be an integer, got 1.5"),
    ({"on_reset": "yes"}, "slow: on_reset must be true or false"),
    ({"env": "slow"}, "slow: env must name another registered environment"),
    ({"env": "guess-numbr"}, "unknown environment 'guess-numbr'; did you mean 'guess-number'?"),
    ({"options": [1]}, "slow: options must be a mapping"),
    ({"options": {"hihg": 3}}, "slow: bad env.options for 'guess-number'"),
    ({"median": 5}, "bad env.options for 'slow'"),
])
def test_bad_options_give_one_line_errors(options, message):
    with pytest.raises(ValueError) as err:
        make_env("slow", **options)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_registered():
    assert "slow" in ENVS and ENVS["slow"] is Slow
