"""Seeded fuzz of the env-value boundary: whatever ``reset`` and ``step`` return or raise
(random types, nested and huge values, non-finite numbers, tuples of the wrong shape,
``BaseException`` subclasses such as ``KeyboardInterrupt``, ``SystemExit`` and
``GeneratorExit``, objects whose ``__str__``, ``__repr__`` or ``__eq__`` raise), each episode
ends with a status and, when it failed, a one-line reason; the run itself never raises or
hangs, and the episode files parse with a strict JSON reader."""

from __future__ import annotations

import json
import math
import random
import time

import numpy as np
import pytest

from turnrl.envs import StepResult
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.types import read_episodes, write_episodes

CASES = 48
"""Episodes per fuzz run (one random behaviour each)."""


class Hostile:
    """An object whose ``__str__``, ``__repr__``, ``__eq__``, ``__hash__`` and ``__bool__``
    raise (``__bool__`` raising GeneratorExit, which is not an ``Exception``)."""

    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __str__

    def __eq__(self, other):
        raise ValueError("no eq")

    def __hash__(self):
        raise TypeError("no hash")

    def __bool__(self):
        raise GeneratorExit


class HostileFloat(float):
    """A float (so a ``numbers.Real``) whose text raises."""

    def __repr__(self):
        raise RuntimeError("no repr")

    __str__ = __repr__


class WeirdError(Exception):
    def __str__(self):
        raise RuntimeError("no message")


ODD_EXCEPTIONS = (KeyboardInterrupt, SystemExit, GeneratorExit, StopIteration,
                  StopAsyncIteration, RecursionError, MemoryError, WeirdError)
LOOP_THREAD_EXCEPTIONS = tuple(e for e in ODD_EXCEPTIONS if e is not KeyboardInterrupt)


def _value(rng: random.Random, depth: int = 0):
    """A random value of a random type, sometimes nested, huge or non-finite."""
    kinds = ["none", "bool", "int", "huge_int", "float", "nan", "inf", "str", "huge_str",
             "bytes", "np", "hostile", "hostile_float", "object", "type"]
    if depth < 3:
        kinds += ["list", "dict", "tuple", "cycle"]
    kind = rng.choice(kinds)
    if kind in ("list", "tuple"):
        items = [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {rng.choice(["success", "seats", "tool_results", "state_key", "x", 3]):
                _value(rng, depth + 1) for _ in range(rng.randrange(4))}
    if kind == "cycle":
        loop: list = [1]
        loop.append(loop)
        return loop
    return {"none": None, "bool": rng.random() < 0.5, "int": rng.randrange(-5, 5),
            "huge_int": 10 ** rng.randrange(20, 500), "float": rng.uniform(-1e308, 1e308),
            "nan": math.nan, "inf": -math.inf, "str": "ok", "huge_str": "y" * 2_000_000,
            "bytes": b"\xff\x00", "np": rng.choice([np.float64(math.nan), np.int8(3),
                                                    np.bool_(True), np.zeros(3)]),
            "hostile": Hostile(), "hostile_float": HostileFloat(1.0), "object": object(),
            "type": int}[kind]


def _step_value(rng: random.Random):
    """What a fuzzed ``step`` returns: sometimes a ``StepResult`` with random fields, a tuple
    of the wrong shape, or a random value."""
    shape = rng.random()
    if shape < 0.6:
        fields = [rng.choice(["fine", _value(rng)]), rng.choice([0.5, _value(rng)]),
                  rng.choice([True, _value(rng)]), rng.choice([{}, None, _value(rng)])]
        return StepResult(*fields)
    if shape < 0.8:
        return tuple(_value(rng) for _ in range(rng.choice([0, 1, 3, 5])))
    return _value(rng)


class FuzzEnv:
    """Seed ``s`` behaves as ``random.Random(s)`` draws: its reset or one of its steps
    returns a random value or raises a random exception (odd ones included)."""

    async def reset(self, seed):
        self.rng = random.Random(seed)
        self.steps = 0
        if self.rng.random() < 0.15:
            raise self.rng.choice(ODD_EXCEPTIONS)()
        return self.rng.choice(["Say a digit."] * 3 + [_value(self.rng)])

    async def step(self, action):
        self.steps += 1
        roll = self.rng.random()
        if roll < 0.1:
            raise self.rng.choice(ODD_EXCEPTIONS)()
        if roll < 0.4:
            return _step_value(self.rng)
        info = {"success": False, "x": _value(self.rng)} if roll < 0.7 else {}
        return StepResult("Again.", 0.25, self.steps >= 2, info)


class FuzzGame:
    """A two-seat game whose ``seat_to_move``, ``observe`` and closing ``info["seats"]`` are
    drawn as ``random.Random(seed)`` says (fine, a random value, or a raise)."""

    seats = ("a", "b")

    async def reset(self, seed):
        self.rng, self.moves = random.Random(seed), 0
        return "Your move."

    def _maybe(self, fine, raises=ODD_EXCEPTIONS):
        roll = self.rng.random()
        if roll < 0.08:
            raise self.rng.choice(raises)()
        return _value(self.rng) if roll < 0.2 else fine

    # Read on the turn loop's thread (the main one here), where a KeyboardInterrupt cannot
    # be told from Ctrl-C: it stops the run, as documented; every other exception is named.
    @property
    def seat_to_move(self):
        return self._maybe("ab"[self.moves % 2], LOOP_THREAD_EXCEPTIONS)

    def observe(self, seat):
        return self._maybe(f"You are {seat}.", LOOP_THREAD_EXCEPTIONS)

    async def step(self, action):
        self.moves += 1
        if self.moves < 3:
            return self._maybe(StepResult("", 0.0, False, {}))
        seats = {seat: {"reward": self.rng.choice([1.0] * 8 + [-1e308, 1e308, math.nan,
                                                               _value(self.rng)])}
                 for seat in self.seats}
        return StepResult("", 0.0, True, {"seats": self._maybe(seats)})


def _one_line(text: str) -> bool:
    return isinstance(text, str) and text and "\n" not in text and len(text) < 11_000


def _play(tiny, env_class):
    model, tok = tiny
    chat = ChatFormat(tok)
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    params = SamplingParams(2, 1.0, 1.0, stop_token_ids=(chat.end_of_turn,))
    seeds = [(seed, seed) for seed in range(CASES)]
    started = time.monotonic()
    episodes = run_sync(run_episodes(env_class, seeds, engine, chat, params, env_name="fuzz",
                                     env_timeout_s=10.0, max_turns=4,
                                     max_context=model.config.max_position_embeddings))
    assert time.monotonic() - started < 240  # nothing waited on a timeout, let alone hung
    return episodes


@pytest.mark.parametrize("env", ["plain", "cooperative", "two seats"])
def test_fuzzed_env_values_fail_their_own_episode_with_a_one_line_reason(tiny, tmp_path, env):
    env_class = {"plain": FuzzEnv, "two seats": FuzzGame,
                 "cooperative": type("Fuzz", (FuzzEnv,), {"cooperative": True})}[env]
    episodes = _play(tiny, env_class)
    seats = 2 if env == "two seats" else 1
    assert sorted(ep.seed for ep in episodes) == sorted(list(range(CASES)) * seats)
    statuses = [ep.status for ep in episodes]
    assert set(statuses) <= {"done", "truncated", "error"}  # truncated: a huge observation
    assert statuses.count("error") > CASES // 4 and statuses.count("done") > 0, statuses
    for ep in episodes:
        if ep.status == "error":
            assert ep.end_reason == "env_error" and _one_line(ep.info["reason"]), ep.info
            assert "env" in ep.info["reason"]  # names the env call that failed
        assert math.isfinite(ep.reward)
    path = tmp_path / "episodes.jsonl"
    write_episodes(path, episodes)
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert len(read_episodes(path)) == CASES * seats


@pytest.mark.parametrize(("step", "reason"), [
    (StepResult("", 1.0, True, {"success": Hostile()}),
     "info['success'] that is not a bool (Hostile: bool() raised GeneratorExit)"),
    (StepResult("", HostileFloat(math.nan), True, {}),
     "step returned reward <HostileFloat: repr raised RuntimeError>; return a finite number"),
    (StepResult("", np.float64(-1e308), True, {}), "gave reward -1e+308 (turn 1): it is not a finite"),
    (StepResult("", 10**400, True, {}), "reward 1000"),
    (StepResult(Hostile(), 1.0, True, {}), "observation of type Hostile; return a str"),
    (StepResult("", 1.0, np.array([True, False]), {}), "done of type ndarray; return a bool"),
    (StepResult("", 1.0, True, {"tool_results": [Hostile()]}), "info['tool_results']"),
    (("", 1.0), "step returned tuple; return StepResult"),
    (KeyboardInterrupt(), "env 'fuzz' step raised KeyboardInterrupt"),
    (SystemExit(3), "env 'fuzz' step raised SystemExit: 3"),
    (WeirdError(), "env step raised WeirdError: <WeirdError: str raised RuntimeError>"),
])
def test_each_hostile_step_value_is_named_in_its_episodes_reason(tiny, step, reason):
    class One(FuzzEnv):
        async def reset(self, seed):
            return "Say a digit."

        async def step(self, action):
            if isinstance(step, BaseException):
                raise step
            return step
    episode = _play(tiny, One)[0]
    assert (episode.status, episode.end_reason) == ("error", "env_error")
    assert reason in episode.info["reason"] and _one_line(episode.info["reason"])
    assert episode.reward == 0.0
