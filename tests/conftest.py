"""Shared fixtures: the tiny random model (real tokenizer, real HF Llama) and a toy env."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from turnrl.envs import StepResult, register_env
from turnrl.models import tiny_model

# Benchmarks and their helpers (harness, step_throughput, warmup) live outside the package;
# tests import them as top-level modules, as `python benchmarks/speed/NAME.py` does.
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path[:0] = [str(BENCHMARKS / part) for part in ("speed", "learning", "guards")]
sys.path.insert(0, str(BENCHMARKS))


@register_env("say-digit")
class SayDigit:
    """Toy task for the tiny model: reward 1 when the reply starts with a digit."""

    def __init__(self, turns: int = 1):
        self.turns, self.turn = turns, 0

    async def reset(self, seed: int) -> str:
        self.turn = 0
        return "Say a digit."

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        ok = action[:1].isdigit()
        done = self.turn >= self.turns
        return StepResult("Again." if not done else "", float(ok) / self.turns, done,
                          {"success": ok})


@register_env("test-chatter")
class Chatter:
    """A two-seat game for the self-play tests in which any reply is a legal move (the tiny
    random model plays whole games): ``moves`` replies, alternating from seat ``a``; the
    longer talker wins (zero-sum). Each seat's result lists its own moves as the env
    received them."""

    seats = ("a", "b")
    zero_sum = True

    def __init__(self, moves: int = 4):
        self.total, self.said = moves, {"a": [], "b": []}

    async def reset(self, seed):
        self.said = {"a": [], "b": []}
        return self.observe("a")

    @property
    def seat_to_move(self):
        return self.seats[sum(map(len, self.said.values())) % 2]

    def observe(self, seat):
        other = "b" if seat == "a" else "a"
        last = self.said[other][-1] if self.said[other] else "nothing yet"
        return f"You are {seat}. {other} said: {last}. Say something."

    async def step(self, action):
        self.said[self.seat_to_move].append(action)
        if sum(map(len, self.said.values())) < self.total:
            return StepResult("", 0.0, False, {})
        talk = {seat: sum(map(len, said)) for seat, said in self.said.items()}
        sign = (talk["a"] > talk["b"]) - (talk["a"] < talk["b"])
        return StepResult("", 0.0, True, {"seats": {
            "a": {"reward": float(sign), "moves": list(self.said["a"])},
            "b": {"reward": float(-sign), "moves": list(self.said["b"])}}})


WORKER_GIB = 4
"""Memory one test worker may hold at once (SmolLM2 runs with AdamW moments, a Ray cluster)."""


def pytest_xdist_auto_num_workers(config) -> int:
    """``make test``'s ``-n auto``: one worker per core this process may use, fewer where the
    available memory holds fewer ``WORKER_GIB`` workers. Many tests wait on subprocesses, Ray
    and sockets, so two workers on two cores overlap those waits."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, int(available_gib() // WORKER_GIB)))


def available_gib() -> float:
    """Memory new processes may take (Linux's MemAvailable counts reclaimable cache)."""
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/meminfo") as info:
            line = next(line for line in info if line.startswith("MemAvailable"))
            return int(line.split()[1]) / 2**20  # kB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)


@pytest.fixture
def tiny():
    return tiny_model(seed=0)


def groups_within(worker, seconds: float) -> list:
    """The first finished groups a ``RolloutWorker`` reports, polling for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if groups := worker.take_groups(wait_s=1.0).groups:
            return groups
    raise AssertionError(f"the worker returned no group within {seconds:.0f} s")


@contextlib.contextmanager
def no_ray_oom_killer():
    """Ray clusters started inside run without Ray's memory monitor: it kills actors (a test's
    workers, its members) once the node's memory is 95% used, which other jobs on the machine
    can bring about (a test failed so beside SmolLM2 runs: 22.6 of 23.5 GB used). A real
    shortage still meets the kernel's OOM killer."""
    before = os.environ.get("RAY_memory_monitor_refresh_ms")
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RAY_memory_monitor_refresh_ms", None)
        else:
            os.environ["RAY_memory_monitor_refresh_ms"] = before


@contextlib.contextmanager
def local_ray(*modules):
    """A Ray cluster of the test's own, with ``modules`` (which define envs the workers cannot
    import) shipped by value. ``address="local"``: never one another process on this machine
    started (a plain ``ray.init`` joins it, then refuses ``num_cpus``)."""
    ray = pytest.importorskip("ray")
    for module in modules:
        ray.cloudpickle.register_pickle_by_value(module)
    with no_ray_oom_killer():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        for module in modules:
            ray.cloudpickle.unregister_pickle_by_value(module)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for a test module whose envs this file registers (say-digit...)."""
    with local_ray(sys.modules[__name__]) as ray:
        yield ray


class MovesEngine:
    """Replies ``moves[k]`` at the ``k``-th generate call, to every row (a lock-step game's
    moves, one per call); made-up logprobs. For bookkeeping tests of games: the tiny random
    model rarely writes a legal move."""

    def __init__(self, tokenizer, moves):
        self.tokenizer, self.moves, self.version, self.calls = tokenizer, moves, 0, 0

    def generate(self, prompts, params):
        from turnrl.samplers import Completion

        text = self.moves[min(self.calls, len(self.moves) - 1)]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = ids + [self.tokenizer.eos_token_id]
        return [Completion(list(ids), [-0.5] * len(ids), "stop") for _ in prompts]


WIDE = {"hidden_size": 256, "num_heads": 4}
"""A tiny model vLLM can load (its kernels need a head size it supports)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The WIDE tiny model saved as a Hugging Face directory (the vLLM GPU tests load it)."""
    model, tokenizer = tiny_model(seed=0, **WIDE)
    path = tmp_path_factory.mktemp("tiny-vllm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class RecordingHandle:
    """A stand-in for a Ray worker handle that records the calls the learner fires at it
    (``handle.method.remote(*args)`` appends ``(method, args)`` to ``log``)."""

    def __init__(self, log: list):
        self.log = log

    def __getattr__(self, method: str):
        return type("Method", (), {"remote": lambda _, *args: self.log.append((method, args))})()
