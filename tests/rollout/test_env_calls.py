"""A misbehaving environment fails its own episode, with its reason, and never stalls the run.

Each test plays real episodes with the tiny model through ``run_episodes`` (the turn loop the
trainers use). On the code before environments got their own threads, the blocking and
CPU-bound cases hung the whole batch (the timeout could not fire) and the malformed returns
crashed it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from turnrl.envs import StepResult
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.rollout.loop import TurnLoop
from turnrl.samplers import HFEngine, SamplingParams

BAD_SEED = 1
BLOCK_S = 30.0
"""How long a misbehaving call blocks or spins: far past the 0.5 s timeout, so a loose bound
on the run (``FREED_S``) tells a run that waited for it from one that did not, however busy
the machine."""
FREED_S = 20.0
spin_until = [0.0]
"""When the CPU-bound step stops spinning: its test sets it to 0 when done, so the thread
(which holds the GIL while it spins) does not slow the tests after it."""


class Env:
    """Seed ``BAD_SEED`` misbehaves in its first step as ``how`` says; the others are fine."""

    def __init__(self, how: str):
        self.how = how

    async def reset(self, seed):
        self.seed = seed
        if seed == BAD_SEED and self.how == "blocking reset":
            time.sleep(BLOCK_S)
        if seed == BAD_SEED and self.how == "int observation on reset":
            return 42
        return "Say a digit."

    async def step(self, action):
        if self.seed == BAD_SEED:
            how = self.how
            if how == "blocking sleep":
                time.sleep(BLOCK_S)  # a blocking call inside async def
            elif how == "cpu-bound":
                spin_until[0] = time.monotonic() + BLOCK_S  # never yields; the test ends it
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


def _play(tiny, how, timeout_s=2.0, env_class=Env):
    model, tok = tiny
    chat = ChatFormat(tok)
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    params = SamplingParams(3, 1.0, 1.0, stop_token_ids=(chat.end_of_turn,))
    started = time.monotonic()
    name = "attrs" if env_class is Attributes else "flaky"
    episodes = run_sync(run_episodes(lambda: env_class(how), [(0, 0), (BAD_SEED, 1), (2, 2)],
                                     engine, chat, params, env_name=name,
                                     env_timeout_s=timeout_s))
    return episodes, time.monotonic() - started


@pytest.mark.parametrize("how", ["blocking sleep", "cpu-bound", "swallows cancellation",
                                 "blocking reset"])
def test_a_call_past_the_timeout_fails_its_episode_whatever_it_does(tiny, how):
    try:
        episodes, seconds = _play(tiny, how)
    finally:
        spin_until[0] = 0.0  # the spinning thread stops now
    bad = episodes[1]
    assert bad.status == "timeout" and "timed out" in bad.info["reason"], bad.info
    assert [ep.status for ep in (episodes[0], episodes[2])] == ["done", "done"]
    # The timeout fired at 2 s (the good episodes' calls, beside a thread spinning on the GIL,
    # are answered within it on a busy machine); nobody waited for the 30 s call (or forever).
    assert seconds < FREED_S, seconds


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
    blocks its thread (for up to ``BLOCK_S``, until ``release`` is set), the mistake
    ``cooperative`` promises not to make."""

    blocks = False
    release = threading.Event()

    def __init__(self, cooperative):
        self.cooperative = cooperative

    async def reset(self, seed):
        return "Say a digit."

    async def step(self, action):
        if Where.blocks:
            Where.blocks = False
            Where.release.wait(BLOCK_S)
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
    Where.release.clear()
    try:
        with pytest.warns(UserWarning, match="'where' declares cooperative = True but blocked"):
            # 5 s: the later episodes' calls, on threads of their own, are answered within it
            # on a busy machine (1.5 s left little slack); far below the 30 s block
            episodes, seconds = _where(tiny, True, groups=4, pool_size=4, timeout_s=5.0)
    finally:
        Where.release.set()  # the blocked thread goes on, and ends, before other tests
    first, later = episodes[:4], episodes[4:]
    assert [ep.status for ep in first] == ["timeout"] * 4  # the blocker and its loop-mates
    assert [ep.status for ep in later] == ["done"] * 4
    assert len({ep.info["thread"] for ep in later}) == 4  # a thread each from then on
    assert seconds < FREED_S  # nobody waited for the 30 s block


STALL_CHILD = r"""
import asyncio, ctypes, json, sys, threading, time, warnings
from turnrl.envs import StepResult
from turnrl.rollout.env_calls import EnvThreads

mode = sys.argv[1]
block, unblocked, done = threading.Event(), threading.Event(), threading.Event()


def spin(cpu_s, work):
    start = time.thread_time()
    while time.thread_time() - start < cpu_s:
        work()


def cpu_seconds(work):
    start = time.thread_time()
    work()
    return time.thread_time() - start


SUM_S_PER_ITEM = min(cpu_seconds(lambda: sum(range(10**6))) for _ in range(3)) / 10**6


class Probe:
    cooperative = True

    async def reset(self, seed):
        return "go"

    async def step(self, action):
        if action == "block" and mode == "sleep":
            time.sleep(2)
        elif action == "block" and mode == "cpu":  # bytecode: hands the GIL over every 5 ms
            spin(1.5, lambda: sum(i for i in range(1000)))
        elif action == "block" and mode == "cpu-in-c":  # one C call holds the GIL throughout
            sum(range(int(2.0 / SUM_S_PER_ITEM)))  # about 2 CPU-s
        await asyncio.sleep(0.005)
        return StepResult("", 1.0, False, {})


threads = EnvThreads("probe")
runner = threads.runner(Probe())
widest = [0.0]


async def drive():
    last = time.monotonic()
    while not done.is_set():
        action = "block" if block.is_set() else "go"
        block.clear()
        await runner.call("step", action, 60.0)
        if action == "block":
            unblocked.set()
        now = time.monotonic()
        widest[0], last = max(widest[0], now - last), now


threading.Thread(target=lambda: asyncio.run(drive()), daemon=True).start()
time.sleep(0.5)
print("ready", flush=True)
sys.stdin.readline()  # "stopped": the parent stopped this process and let it go on
if mode == "gil-elsewhere":  # another thread holds the GIL for 2 s in one C call
    holder = threading.Thread(target=ctypes.PyDLL(None).usleep, args=(2_000_000,))
    holder.start()
    holder.join()
elif mode in ("sleep", "cpu", "cpu-in-c"):
    block.set()
    unblocked.wait(60)
time.sleep(1.0)  # a few heartbeats after it
stalled = threads.shared.stalled
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    later = threads.runner(Probe())
done.set()
print(json.dumps({"stalled": stalled, "shared": later.shared is not None, "widest": widest[0],
                  "warnings": [str(w.message) for w in caught]}), flush=True)
threads.close()
"""


def _stall_child(mode):
    """Run ``STALL_CHILD`` in ``mode``: a cooperative env stepping on its shared loop in a
    process of its own (so it can be stopped), then what its shared loop concluded."""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    child = subprocess.Popen([sys.executable, "-c", STALL_CHILD, mode], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, cwd=root)
    try:
        assert child.stdout.readline().strip() == "ready"
        if mode == "stopped":  # the whole process descheduled, as on a busy machine
            os.kill(child.pid, signal.SIGSTOP)
            time.sleep(1.5)
            os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate("go\n", timeout=180)
    finally:
        child.kill()
    assert child.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["sleep", "cpu", "cpu-in-c"])
def test_a_cooperative_env_that_blocks_its_loop_is_named_whatever_blocks_it(mode):
    """A ``time.sleep``, a CPU-bound loop in bytecode and one C call that holds the GIL while
    it computes (the control thread is late then too: the loop thread's CPU time tells)."""
    seen = _stall_child(mode)
    assert seen["stalled"] and not seen["shared"], seen
    assert len(seen["warnings"]) == 1, seen
    assert "'probe' declares cooperative = True but blocked" in seen["warnings"][0]


@pytest.mark.parametrize("mode", ["stopped", "gil-elsewhere"])
def test_a_starved_process_does_not_blame_its_cooperative_env(mode):
    """The env never blocks; the process is not run for 1.5-2 s (stopped by a signal, or
    another thread holding the GIL in one C call). Its loop's heartbeat was as late as a
    blocked one's (``widest``: the old check warned here), but the control thread was late
    too: no warning, the loop stays shared."""
    seen = _stall_child(mode)
    assert seen["widest"] > 1.2, seen  # the starvation happened, and held up the env's calls
    assert not seen["stalled"] and seen["shared"] and seen["warnings"] == [], seen


def test_blocked_seconds_count_the_wall_outside_starvation_or_the_loop_threads_cpu():
    from turnrl.rollout.env_calls import blocked_seconds

    assert blocked_seconds(10.0, 12.0, [], 0.0) == 2.0  # a sleep: all of it
    assert blocked_seconds(10.0, 12.0, [(10.2, 11.9)], 0.0) == pytest.approx(0.3)  # starved
    # Windows count only where they overlap the gap; several add up.
    assert blocked_seconds(10.0, 12.0, [(9.0, 10.5), (11.0, 11.5), (13.0, 14.0)],
                           0.0) == pytest.approx(1.0)
    # A C call that held the GIL made the control thread late too: its CPU time is its own.
    assert blocked_seconds(10.0, 12.0, [(10.0, 12.0)], 1.8) == pytest.approx(1.8)


def test_closing_the_shared_loop_ends_its_thread_and_its_control_thread():
    from turnrl.rollout.env_calls import SharedLoop

    shared = SharedLoop("closing")
    time.sleep(0.6)  # a few beats on both
    assert shared.thread.is_alive() and shared.control.is_alive() and not shared.stalled
    shared.close()
    shared.thread.join(10)
    shared.control.join(10)
    assert not shared.thread.is_alive() and not shared.control.is_alive()


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
        time.sleep(2.0)  # this loop is busy (a long generate call) while the tool answers
        await call
        with pytest.raises(TimeoutError):
            await runner.call("step", 2.0, 0.2, seconds)

    try:
        run_sync(busy_caller())
        time.sleep(0.1)  # a cancelled call must not add a sample of its own
    finally:
        runner.close()
    assert 0.05 <= seconds[0] < 1.5  # timed from this loop it would be >= 2.0
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
    assert time.perf_counter() - started < 15.0  # half the 30 s timeout: it was not waited for


# ---- what an env returns enters the episode JSON-safe and bounded --------------------------


class Weird:
    """A custom object whose repr and str raise."""

    def __repr__(self):
        raise ValueError("no repr")

    __str__ = __repr__


class Thing:
    def __repr__(self):
        return "Thing()"


def _nasty_info():
    import numpy as np
    import torch

    loop = {"name": "loop"}
    loop["self"] = loop
    deep: dict = {}
    node = deep
    for _ in range(100):
        node["next"] = {}
        node = node["next"]
    return {"set": {3, 1, 2}, "bytes": b"\x00\xff", "np_float": np.float32(0.5),
            "np_int": np.int64(7), "np_bool": np.bool_(True), "array": np.arange(6).reshape(2, 3),
            "big_array": np.zeros(100_000), "tensor": torch.tensor([1.5, 2.5]),
            "big_tensor": torch.zeros(50_000), "weird": Weird(), "thing": Thing(),
            "loop": loop, "deep": deep, "huge_str": "x" * 5_000_000,
            "huge_list": list(range(1_000_000)), "nan": math.nan, "inf": -math.inf,
            "tuple_keys": {(1, 2): "pair"}, "int_keys": {1: "one"}, "huge_int": 10**40}


class InfoEnv:
    """One turn; seed 1's step returns ``info`` full of values JSON cannot write as they are."""

    async def reset(self, seed):
        self.seed = seed
        return "Say a digit."

    async def step(self, action):
        info = _nasty_info() if self.seed == 1 else {}
        return StepResult("", 1.0, True, {"success": True, **info})


def test_any_info_an_env_returns_is_kept_json_safe_and_bounded(tiny, tmp_path):
    """Before, the first value JSON cannot write crashed the run while writing the episode
    file, after the half-written line; a huge string or list was kept whole."""
    from turnrl.types import read_episodes, write_episodes

    model, tok = tiny
    chat = ChatFormat(tok)
    episodes = run_sync(run_episodes(InfoEnv, [(0, 0), (1, 1)],
                                     HFEngine(model, tok.pad_token_id, seed=0), chat,
                                     SamplingParams(3, 1.0, 1.0), env_name="info"))
    path = tmp_path / "episodes.jsonl"
    write_episodes(path, episodes)
    assert path.stat().st_size < 1_000_000  # 5 MB of string and 1M ints were not kept whole
    back = read_episodes(path)
    info = back[1].info
    assert [ep.status for ep in back] == ["done", "done"] and back[1].success
    assert info["set"] == [1, 2, 3] and info["bytes"].startswith("<bytes: 2>")
    assert (info["np_float"], info["np_int"], info["np_bool"]) == (0.5, 7, True)
    assert info["array"] == [[0, 1, 2], [3, 4, 5]] and info["tensor"] == [1.5, 2.5]
    assert info["big_array"] == "<ndarray shape=(100000,) dtype=float64>"
    assert info["big_tensor"] == "<Tensor shape=(50000,) dtype=float32>"
    assert info["weird"] == "<Weird: repr raised ValueError>"
    assert info["thing"] == "<Thing: Thing()>"
    assert info["loop"] == {"name": "loop", "self": "<cycle: dict>"}
    assert "nested over" in json.dumps(info["deep"])
    assert len(info["huge_str"]) < 10_100 and info["huge_str"].endswith("more chars]")
    assert len(info["huge_list"]) == 1001 and "999000 more items" in info["huge_list"][-1]
    assert (info["nan"], info["inf"]) == (None, None)
    assert info["tuple_keys"] == {"(1, 2)": "pair"} and info["int_keys"] == {"1": "one"}
    assert info["huge_int"] == str(10**40)
    json.loads(path.read_text().splitlines()[1])  # standard JSON: no NaN, no Infinity


@pytest.mark.parametrize(("info", "reason"), [
    ({"success": __import__("numpy").array([True, False])},
     "info['success'] that is not a bool (ndarray: bool() raised ValueError)"),
    ({"tool_results": "cat: done"}, "info['tool_results'] of type str; return a list of dicts"),
    ({"tool_results": ["cat: done"]}, "info['tool_results'] of type list"),
])
def test_info_the_loop_reads_fails_its_episode_when_unreadable(tiny, info, reason):
    class Env:
        async def reset(self, seed):
            return "Say a digit."

        async def step(self, action):
            return StepResult("", 1.0, False, info)

    model, tok = tiny
    chat = ChatFormat(tok)
    [episode] = run_sync(run_episodes(Env, [(0, 0)], HFEngine(model, tok.pad_token_id, seed=0),
                                      chat, SamplingParams(3, 1.0, 1.0), env_name="odd"))
    assert (episode.status, episode.end_reason) == ("error", "env_error")
    assert reason in episode.info["reason"], episode.info


@pytest.mark.parametrize("how", ["huge message", "str raises"])
def test_an_exception_the_env_raises_becomes_a_bounded_reason(tiny, how):
    class Boom(Exception):
        def __str__(self):
            if how == "str raises":
                raise RuntimeError("no message")
            return "boom " * 1_000_000

    class Env:
        async def reset(self, seed):
            return "Say a digit."

        async def step(self, action):
            raise Boom

    model, tok = tiny
    [episode] = run_sync(run_episodes(Env, [(0, 0)], HFEngine(model, tok.pad_token_id, seed=0),
                                      ChatFormat(tok), SamplingParams(3, 1.0, 1.0)))
    assert episode.end_reason == "env_error" and len(episode.info["reason"]) < 10_100
    assert episode.info["reason"].startswith("env step raised Boom: ")
    episode.to_json()


def test_episode_files_are_all_or_nothing_and_a_torn_last_line_is_skipped(tmp_path):
    """A write that fails part-way leaves the file as it was (no partial record, no temp
    file); a file torn by a crash of a run from before (half a last line) still reads."""
    from turnrl.types import Episode, read_episodes, write_episodes

    path = tmp_path / "episodes.jsonl"
    write_episodes(path, [Episode("e", 0, 0, reward=1.0)])
    before = path.read_bytes()

    def crashing():
        yield Episode("e", 1, 1)
        raise RuntimeError("crash while writing")

    with pytest.raises(RuntimeError):
        write_episodes(path, crashing())
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "episodes.jsonl"]
    whole = Episode("e", 2, 2).to_json()
    path.write_text(before.decode() + whole + "\n" + whole[:len(whole) // 2])  # torn tail
    assert [ep.seed for ep in read_episodes(path)] == [0, 2]
    path.write_text(whole[:10] + "\n" + whole + "\n")  # corruption before the end raises
    with pytest.raises(ValueError, match="episodes.jsonl:1: corrupt episode line"):
        read_episodes(path)


# ---- huge env text is refused before it is rendered or tokenised --------------------------


class Spy(ChatFormat):
    """The real chat format, remembering the longest text it was asked to render or encode."""

    longest = 0

    def render(self, messages, generation_prompt, tools=None):
        Spy.longest = max(Spy.longest, sum(len(m["content"] or "") for m in messages))
        return super().render(messages, generation_prompt, tools)

    def encode(self, text):
        Spy.longest = max(Spy.longest, len(text))
        return super().encode(text)


HUGE = 3_000_000


class HugeEnv:
    """Says too much where ``how`` says; seed 1 only."""

    def __init__(self, how):
        self.how, self.turn = how, 0
        if how == "huge system prompt":
            self.system_prompt = "Be brief. " * (HUGE // 10)

    async def reset(self, seed):
        self.seed = seed
        return "y" * HUGE if self.how == "huge reset prompt" else "Say a digit."

    async def step(self, action):
        self.turn += 1
        if self.how == "huge observation":
            return StepResult("z" * HUGE, 0.0, False, {})
        if self.how == "huge tool result":
            from turnrl.tools.calls import ToolResult, format_tool_results

            result = ToolResult("cat", "w" * HUGE)
            return StepResult(format_tool_results([result]), 0.0, False,
                              {"tool_results": [{"name": "cat", "content": result.content}]})
        if self.how == "many medium observations":
            return StepResult(f"Turn {self.turn}. " + "m" * 200, 0.0, False, {})
        return StepResult("", 1.0, True, {})


@pytest.mark.parametrize("how", ["huge reset prompt", "huge system prompt", "huge observation",
                                 "huge tool result", "many medium observations"])
def test_env_text_that_cannot_fit_the_context_never_reaches_the_template(tiny, how):
    """Before, each of these was rendered and tokenised whole (seconds and gigabytes per
    episode: 7 s for 2 MB with the tiny tokenizer), and only then thrown away by the context
    check. Now text longer than the context can hold (max_context x the tokenizer's most
    characters a token: 1024 x 13 for the tiny one) ends its episode first, with the sizes
    in its reason; text under the bound still meets the exact token check."""
    from turnrl.rollout.input_bounds import max_chars_per_token

    model, tok = tiny
    Spy.longest = 0
    chat = Spy(tok)
    bound = 1024 * max_chars_per_token(tok)
    started = time.monotonic()
    episodes = run_sync(run_episodes(lambda: HugeEnv(how), [(0, 0), (1, 1)],
                                     HFEngine(model, tok.pad_token_id, seed=0), chat,
                                     SamplingParams(3, 1.0, 1.0), env_name="huge",
                                     max_turns=50, max_context=1024))
    seconds = time.monotonic() - started
    bad = episodes[1]
    assert Spy.longest <= bound, (Spy.longest, bound)
    assert len(bad.token_ids) <= 1024 and bad.status == "truncated"
    if how == "many medium observations":  # several turns fit; the one that does not, ends it
        assert len(bad.turns) > 2 and bad.end_reason in ("context_length", "input_too_large")
    else:
        assert bad.end_reason == "input_too_large", bad.info
        chars = int(re.search(r"of ([\d,]+) chars cannot fit", bad.info["reason"])[1]
                    .replace(",", ""))
        assert HUGE - 10 <= chars <= HUGE + 100, bad.info["reason"]
        assert len(bad.to_json()) < 100_000  # what is stored is a preview, not megabytes
    assert seconds < 60  # loose: a busy machine; the whole texts took longer than this


# ---- every ended episode says why ---------------------------------------------------------


class Endings:
    """Seed n ends its episode the n-th way of ``ENDINGS``."""

    async def reset(self, seed):
        self.seed = seed
        return "Say a digit."

    async def step(self, action):
        how = ENDINGS[self.seed]
        if how == "env_error":
            raise KeyError("no such tool")
        if how == "env_timeout":
            await asyncio.sleep(10)
        if how == "input_too_large":
            return StepResult("z" * 100_000, 0.0, False, {})
        if how == "context_length":
            return StepResult("c" * 2_000, 0.0, False, {})  # under the bound, over the context
        return StepResult("Again.", 1.0, how == "done", {})  # turn_limit: never done


ENDINGS = ["done", "turn_limit", "env_error", "env_timeout", "input_too_large",
           "context_length", "done"]


def test_every_ended_episode_carries_its_reason_and_evaluation_counts_them(tiny, tmp_path):
    """Before, an episode out of turns ended ``truncated`` with no reason at all, and the
    other endings kept theirs only as free text in ``info``."""
    from turnrl.evaluation import count_end_reasons, summarize, summarize_samples
    from turnrl.types import END_REASONS, Episode, read_episodes, write_episodes

    model, tok = tiny
    episodes = run_sync(run_episodes(Endings, [(s, s) for s in range(len(ENDINGS))],
                                     HFEngine(model, tok.pad_token_id, seed=0), ChatFormat(tok),
                                     SamplingParams(3, 1.0, 1.0), env_name="endings",
                                     max_turns=2, max_context=1024, env_timeout_s=3.0))
    write_episodes(tmp_path / "e.jsonl", episodes)
    back = read_episodes(tmp_path / "e.jsonl")
    assert [ep.end_reason for ep in back] == ENDINGS
    assert set(ENDINGS) <= set(END_REASONS)
    assert [ep.status for ep in back] == ["done", "truncated", "error", "timeout", "truncated",
                                          "truncated", "done"]
    assert back[1].info["reason"] == "turn limit (2 turns)"
    expected = {"done": 2, "turn_limit": 1, "env_error": 1, "env_timeout": 1,
                "input_too_large": 1, "context_length": 1}
    assert summarize(back).end_reasons == expected
    assert summarize(back).to_dict()["end_reasons"] == expected
    assert summarize_samples("p", back, 1).to_dict()["end_reasons"] == expected
    # Files from before end reasons existed count by their status.
    old = Episode("e", 0, 0, status="truncated")
    assert count_end_reasons([old, back[0]]) == {"done": 1, "truncated": 1}


def test_a_huge_state_key_is_kept_as_a_bounded_digest_that_still_tells_states_apart():
    from turnrl.rollout.env_calls import MAX_STATE_CHARS, state_text

    a, b = "s" * 1_000_000 + "a", "s" * 1_000_000 + "b"
    assert len(state_text(a)) < 300 and state_text(a) != state_text(b)
    assert state_text(a) == state_text("s" * 1_000_000 + "a")  # equal states stay equal
    assert state_text("small") == "small" and len("x" * MAX_STATE_CHARS) == MAX_STATE_CHARS
    assert state_text(Weird()) == "<Weird>"


class Attributes:
    """Seed 1's env makes an attribute the loop reads after reset raise or mistyped."""

    def __init__(self, how):
        self.how = how

    async def reset(self, seed):
        self.seed = seed
        return "Say a digit."

    @property
    def system_prompt(self):
        if self.seed == BAD_SEED and self.how == "system_prompt raises":
            raise RuntimeError("no prompt today")
        if self.seed == BAD_SEED and self.how == "system_prompt not text":
            return ["Be brief."]
        return None

    @property
    def state_key(self):
        if self.seed == BAD_SEED and self.how == "state_key raises":
            raise KeyError("board")
        return f"start-{self.seed}"

    async def step(self, action):
        return StepResult("", 1.0, True, {"success": True})


@pytest.mark.parametrize(("how", "reason"), [
    ("system_prompt raises", "env 'attrs' system_prompt, tool_prompt or state_key raised "
                             "RuntimeError: no prompt today"),
    ("state_key raises", "raised KeyError: 'board'"),
    ("system_prompt not text", "env 'attrs' system_prompt is list; make it a str or None"),
])
def test_an_env_attribute_that_raises_or_is_mistyped_fails_its_episode_not_the_run(tiny, how,
                                                                                   reason):
    """Before, the loop read these bare, so a raising property crashed the whole run."""
    episodes, _ = _play(tiny, how, timeout_s=5, env_class=Attributes)
    bad = episodes[1]
    assert (bad.status, bad.end_reason) == ("error", "env_error")
    assert reason in bad.info["reason"], bad.info
    assert [ep.status for ep in (episodes[0], episodes[2])] == ["done", "done"]
