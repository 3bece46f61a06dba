"""A misbehaving environment fails its own episode, with its reason, and never stalls the run.

Each test plays real episodes with the tiny model through ``run_episodes`` (the turn loop the
trainers use). On the code before environments got their own threads, the blocking and
CPU-bound cases hung the whole batch (the timeout could not fire) and the malformed returns
crashed it.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from turnrl.envs import StepResult
from turnrl.rollout import ChatFormat, HFEngine, SamplingParams, run_episodes, run_sync
from turnrl.rollout.loop import TurnLoop

BAD_SEED = 1
SPIN_S = 3.0
spin_until = [0.0]
"""When the CPU-bound step stops spinning: its test waits that out, so the thread (which
holds the GIL while it spins) does not slow the tests after it."""


class Env:
    """Seed ``BAD_SEED`` misbehaves in its first step as ``how`` says; the others are fine."""

    def __init__(self, how: str):
        self.how = how

    async def reset(self, seed):
        self.seed = seed
        if seed == BAD_SEED and self.how == "blocking reset":
            time.sleep(3)
        if seed == BAD_SEED and self.how == "int observation on reset":
            return 42
        return "Say a digit."

    async def step(self, action):
        if self.seed == BAD_SEED:
            how = self.how
            if how == "blocking sleep":
                time.sleep(3)  # a blocking call inside async def
            elif how == "cpu-bound":
                spin_until[0] = time.monotonic() + SPIN_S  # never yields; ends by itself
                while time.monotonic() < spin_until[0]:
                    pass
            elif how == "swallows cancellation":
                while True:
                    try:
                        await asyncio.sleep(10)
                    except asyncio.CancelledError:
                        pass
            elif how == "raises":
                raise KeyError("no such tool")
            elif how == "int observation":
                return StepResult(7, 1.0, True, {})
            elif how == "nan reward":
                return StepResult("", math.nan, True, {})
            elif how == "inf reward":
                return StepResult("", math.inf, True, {})
            elif how == "tuple":
                return ("ok", 1.0, True)
            elif how == "string done":
                return StepResult("", 1.0, "yes", {})
            elif how == "list info":
                return StepResult("", 1.0, True, ["success"])
        return StepResult("", 1.0, True, {"success": True})


class CooperativeEnv(Env):
    """The same env declaring that it never blocks: its episodes share one env thread."""

    cooperative = True


def _play(tiny, how, timeout_s=0.5, env_class=Env):
    model, tok = tiny
    chat = ChatFormat(tok)
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    params = SamplingParams(3, 1.0, 1.0, stop_token_ids=(chat.end_of_turn,))
    started = time.monotonic()
    episodes = run_sync(run_episodes(lambda: env_class(how), [(0, 0), (BAD_SEED, 1), (2, 2)],
                                     engine, chat, params, env_name="flaky",
                                     env_timeout_s=timeout_s))
    return episodes, time.monotonic() - started


@pytest.mark.parametrize("how", ["blocking sleep", "cpu-bound", "swallows cancellation",
                                 "blocking reset"])
def test_a_call_past_the_timeout_fails_its_episode_whatever_it_does(tiny, how):
    episodes, seconds = _play(tiny, how)
    time.sleep(max(0.0, spin_until[0] - time.monotonic()))
    bad = episodes[1]
    assert bad.status == "timeout" and "timed out" in bad.info["reason"], bad.info
    assert [ep.status for ep in (episodes[0], episodes[2])] == ["done", "done"]
    # The timeout fired at 0.5 s; nobody waited for the 3 s call (or forever).
    assert seconds < 2.5, seconds


@pytest.mark.parametrize(("how", "reason"), [
    ("raises", "env step raised KeyError"),
    ("int observation", "env 'flaky' step returned observation of type int; return a str"),
    ("int observation on reset", "env 'flaky' reset returned int, not str"),
    ("nan reward", "env 'flaky' step returned reward nan; return a finite number"),
    ("inf reward", "env 'flaky' step returned reward inf"),
    ("tuple", "env 'flaky' step returned tuple; return StepResult"),
    ("string done", "env 'flaky' step returned done of type str"),
    ("list info", "env 'flaky' step returned info of type list"),
])
@pytest.mark.parametrize("env_class", [Env, CooperativeEnv])
def test_a_malformed_return_fails_its_episode_with_a_reason_naming_the_field(tiny, how, reason,
                                                                             env_class):
    episodes, _ = _play(tiny, how, timeout_s=5, env_class=env_class)
    bad = episodes[1]
    assert bad.status == "error" and reason in bad.info["reason"], bad.info
    assert math.isfinite(bad.reward)  # a NaN reward never reaches the episode's total
    assert [ep.status for ep in (episodes[0], episodes[2])] == ["done", "done"]


class Where:
    """Records the thread each step runs on; ``blocks`` (class-wide): the first step of all
    blocks for 3 s with ``time.sleep``, the mistake ``cooperative`` promises not to make."""

    blocks = False

    def __init__(self, cooperative):
        self.cooperative = cooperative

    async def reset(self, seed):
        return "Say a digit."

    async def step(self, action):
        if Where.blocks:
            Where.blocks = False
            time.sleep(3.0)
        await asyncio.sleep(0.01)
        return StepResult("", 1.0, True, {"thread": threading.get_ident()})


def _where(tiny, cooperative, groups, pool_size=None, timeout_s=30.0):
    model, tok = tiny
    chat = ChatFormat(tok)
    loop = TurnLoop(lambda: Where(cooperative), HFEngine(model, tok.pad_token_id, seed=0), chat,
                    SamplingParams(3, 1.0, 1.0, stop_token_ids=(chat.end_of_turn,)),
                    group_size=2, pool_size=pool_size, env_name="where",
                    env_timeout_s=timeout_s)
    for group in range(groups):
        loop.submit(group, group)
    started = time.monotonic()
    run_sync(loop.run(until_drained=True))
    finished = sorted(loop.take_groups(), key=lambda g: g.assignment)
    return [ep for g in finished for ep in g.episodes], time.monotonic() - started


@pytest.mark.parametrize("cooperative", [False, True])
def test_cooperative_envs_share_one_thread_and_the_others_get_one_each(tiny, cooperative):
    episodes, _ = _where(tiny, cooperative, groups=4)  # all 8 live at once
    assert [ep.status for ep in episodes] == ["done"] * 8
    threads = {ep.info["thread"] for ep in episodes}
    assert len(threads) == (1 if cooperative else 8)
    assert threading.get_ident() not in threads  # never the turn loop's own


def test_a_cooperative_env_that_blocks_stalls_only_its_loop_mates_and_then_loses_the_share(tiny):
    """The documented price of ``cooperative``: a step that blocks anyway holds up the calls
    sharing its loop until they time out (the turn loop itself goes on); after that every env
    gets its own thread, with a warning that names the env and the fix."""
    Where.blocks = True
    with pytest.warns(UserWarning, match="'where' declares cooperative = True but blocked"):
        episodes, seconds = _where(tiny, True, groups=4, pool_size=4, timeout_s=1.5)
    first, later = episodes[:4], episodes[4:]
    assert [ep.status for ep in first] == ["timeout"] * 4  # the blocker and its loop-mates
    assert [ep.status for ep in later] == ["done"] * 4
    assert len({ep.info["thread"] for ep in later}) == 4  # a thread each from then on
    assert seconds < 2.9  # nobody waited for the 3 s block
    time.sleep(3.0 - min(seconds, 3.0))  # let the blocked thread finish before other tests


def test_plain_def_environments_are_accepted(tiny):
    class Plain:
        def reset(self, seed):
            return "Say a digit."

        def step(self, action):
            return StepResult("", 1.0, True, {"success": True})

    model, tok = tiny
    chat = ChatFormat(tok)
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    episodes = run_sync(run_episodes(Plain, [(0, 0), (1, 1)], engine, chat,
                                     SamplingParams(3, 1.0, 1.0), env_name="plain"))
    assert [ep.status for ep in episodes] == ["done", "done"]


def test_a_conversation_that_would_outgrow_the_context_ends_truncated_within_it(tiny):
    """Model output that keeps a conversation going past the model's context: the episode
    ends before an env reply or the next turn would overflow it, with the reason recorded
    (before, the reply that overflowed was appended: an episode longer than the model's
    positions, which the update cannot score)."""
    from functools import partial

    from turnrl.envs import make_env

    model, tok = tiny
    chat = ChatFormat(tok)
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    params = SamplingParams(8, 1.0, 1.0, stop_token_ids=(chat.end_of_turn,))
    env = make_env("guess-number")
    first = len(chat.start(asyncio.run(env.reset(3)), env.system_prompt)[2])
    make = partial(make_env, "guess-number", max_turns=10)
    for limit, turns in ((first + 60, True), (first + 4, False)):  # a turn or two; none
        [episode] = run_sync(run_episodes(make, [(3, 0)], engine, chat, params,
                                          max_context=limit))
        assert episode.status == "truncated" and episode.info["reason"] == "context length"
        assert len(episode.token_ids) <= limit and bool(episode.turns) == turns


def test_an_env_call_is_timed_on_its_own_thread_not_by_when_the_loop_noticed():
    """Async mode sizes its pool by env latency. Timed from the turn loop, a 50 ms tool looks
    as slow as the generate call the loop was busy with (a bigger pool, longer calls, a
    bigger pool...); timed on the env's thread it is 50 ms. A call past its timeout counts
    as the timeout."""
    from turnrl.rollout.env_calls import EnvRunner

    class Tool:
        async def step(self, seconds):
            await asyncio.sleep(seconds)
            return StepResult("done", 0.0, True)

    runner, seconds = EnvRunner(Tool(), "tool"), []

    async def busy_caller():
        call = asyncio.ensure_future(runner.call("step", 0.05, 5.0, seconds))
        await asyncio.sleep(0.01)  # the call is on the env's thread now
        time.sleep(1.0)  # this loop is busy (a long generate call) while the tool answers
        await call
        with pytest.raises(TimeoutError):
            await runner.call("step", 2.0, 0.2, seconds)

    try:
        run_sync(busy_caller())
        time.sleep(0.1)  # a cancelled call must not add a sample of its own
    finally:
        runner.close()
    assert 0.05 <= seconds[0] < 0.8  # timed from this loop it would be >= 1.0
    assert seconds[1:] == [0.2]


def test_a_call_that_timed_out_or_whose_caller_left_is_cancelled_on_the_env_loop():
    """The env's own task is cancelled when its call times out or its caller is cancelled
    (the run stops): a tool left running would keep its thread busy for nothing."""
    from turnrl.rollout.env_calls import EnvRunner

    class Tool:
        finished, cancelled = 0, 0

        async def step(self, seconds):
            try:
                await asyncio.sleep(seconds)
            except asyncio.CancelledError:
                Tool.cancelled += 1
                raise
            Tool.finished += 1
            return StepResult("done", 0.0, True)

    runner = EnvRunner(Tool(), "tool")

    async def calls():
        with pytest.raises(TimeoutError):
            await runner.call("step", 1.0, 0.1)
        caller = asyncio.ensure_future(runner.call("step", 1.0, 30.0))
        await asyncio.sleep(0.1)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        return await runner.call("step", 0.01, 5.0)  # the runner still answers

    try:
        assert run_sync(calls()).observation == "done"
        time.sleep(1.2)  # long enough for either sleep to have ended, had it not been cancelled
    finally:
        runner.close()
    assert (Tool.cancelled, Tool.finished) == (2, 1)


def test_an_env_that_raises_cancelled_error_itself_fails_its_call_at_once():
    """A CancelledError from inside the env (one of its own tasks cancelled), not from a
    timeout: the call fails with a reason now, instead of hanging until the timeout."""
    from turnrl.rollout.env_calls import EnvError, EnvRunner

    class Tool:
        async def step(self, _):
            raise asyncio.CancelledError

    runner = EnvRunner(Tool(), "tool")

    async def call():
        with pytest.raises(EnvError, match="CancelledError"):
            await runner.call("step", None, 30.0)

    started = time.perf_counter()
    try:
        run_sync(call())
    finally:
        runner.close()
    assert time.perf_counter() - started < 5.0
