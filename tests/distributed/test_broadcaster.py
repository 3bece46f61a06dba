"""How the learner forms the weight group (``WeightBroadcaster``, broadcaster.py) when members
misbehave: a group formed but refused is closed before the error, the workers are asked
together (one timeout in all, not one a worker), and a group formed with no worker up says so
when asked to send. Real gloo groups between this process and small Ray actors that play the
worker's side with the real ``WeightReceiver`` (tests/distributed/test_weight_sync.py runs whole
training runs through the group)."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from tests.conftest import local_ray
from turnrl.distributed import broadcaster as broadcaster_module
from turnrl.distributed.broadcaster import NO_MEMBERS, WeightBroadcaster
from turnrl.distributed.weight_sync import (
    PREFIX,
    WeightGroupError,
    WeightReceiver,
    new_group,
    weights_digest,
)

CPU = torch.device("cpu")


class Member:
    """The worker's side of the group, in one of these modes: ``joins`` (as a rollout worker
    does), ``refuses`` (joins, then answers a reason), ``half`` (makes the group but never
    takes part in its first broadcast), ``silent`` (answers nothing for a minute)."""

    def __init__(self) -> None:
        self.mode = "joins"
        self.receiver = WeightReceiver(CPU)
        self.kept: list = []
        self.received: dict = {}

    def set_mode(self, mode: str) -> str:
        self.mode = mode
        return mode

    def weights_device(self) -> tuple[str, str]:
        if self.mode == "silent":
            time.sleep(60)
        return ("cpu", "")

    def join_weight_group(self, address, port, rank, world, backend, generation,
                          timeout_s) -> str:
        if self.mode == "half":
            store = torch.distributed.TCPStore(address, port, world, False)
            self.kept = [store, new_group(store, f"{PREFIX}-{generation}/", rank, world, backend,
                                          timeout_s)]
            return ""
        reason = self.receiver.join(address, port, rank, world, backend, generation, timeout_s)
        return reason or ("refused after joining" if self.mode == "refuses" else "")

    def receive_weights(self, version, generation, layout) -> bool:
        state = self.receiver.receive(generation, layout)
        if state is not None:
            self.received[version] = weights_digest(state)
        return state is not None

    def digest(self, version: int) -> str:
        return self.received.get(version, "")


@pytest.fixture(scope="module")
def ray():
    with local_ray(sys.modules[__name__]) as ray:
        yield ray


@pytest.fixture(scope="module")
def members(ray):
    """Four started members (threaded: a silent call does not block the next test)."""
    actor = ray.remote(Member).options(num_cpus=0, max_concurrency=8)
    handles = [actor.remote() for _ in range(4)]
    # loose: at load 9-14 on 2 cores this fixture took 289 s (four actors importing torch)
    ray.get([h.set_mode.remote("joins") for h in handles], timeout=900)
    return handles


def _with_modes(ray, members, *modes: str) -> dict[int, object]:
    handles = dict(enumerate(members[:len(modes)]))
    ray.get([h.set_mode.remote(m) for h, m in zip(handles.values(), modes, strict=True)],
            timeout=60)
    return handles


def _kill(ray, handle) -> None:
    """Kill an actor and return once a call to it fails: ``ray.kill`` returns before the
    actor is down, and a call sent meanwhile can still be answered (CI saw a killed member
    say where it keeps weights)."""
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            ray.get(handle.weights_device.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("a killed actor still answered after 300 s")


def _closed_groups(monkeypatch) -> list:
    """The groups the broadcaster closes (the real ``close_group`` still runs)."""
    closed = []
    real = broadcaster_module.close_group

    def recording(group):
        closed.append(group)
        real(group)

    monkeypatch.setattr(broadcaster_module, "close_group", recording)
    return closed


def test_members_that_join_form_a_group_that_carries_a_version(ray, members):
    """The control: the actors above play the worker's side well enough to form and send."""
    handles = _with_modes(ray, members, "joins", "joins")
    sender = WeightBroadcaster(timeout_s=60, address="127.0.0.1")
    sender.form(ray, handles, {0: "a", 1: "b"}, CPU)
    try:
        state = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2)}
        fired = []
        assert sender.send(3, state, fired.append) and sender.failure == ""
        assert all(ray.get(fired, timeout=60))
        digests = ray.get([h.digest.remote(3) for h in handles.values()], timeout=60)
        assert digests == [weights_digest({**state})] * 2
    finally:
        sender.close()


@pytest.mark.parametrize("modes, reason, timeout_s", [
    # the answers, after the check: the group forms first (30 s: a busy machine's gloo
    # rendezvous of three processes may take over 5 s, and the refusal would go unheard)
    (("joins", "refuses"), "worker 1: refused after joining", 30),
    (("half",), "(RuntimeError: ", 5),  # the group's first broadcast times out
])
def test_a_group_formed_but_refused_is_closed_before_the_error(ray, members, monkeypatch,
                                                               modes, reason, timeout_s):
    closed = _closed_groups(monkeypatch)
    sender = WeightBroadcaster(timeout_s=timeout_s, address="127.0.0.1")
    with pytest.raises(WeightGroupError) as err:
        sender.form(ray, _with_modes(ray, members, *modes), dict.fromkeys(range(len(modes)),
                                                                         "x"), CPU)
    message = str(err.value)
    assert "\n" not in message and f"did not form within {timeout_s} s" in message
    assert reason in message, message
    formed = [g for g in closed if g is not None]
    assert len(formed) == 1, closed  # the group made in this formation, closed (not leaked)
    assert sender.group is None and sender.members == {}


def test_every_silent_worker_is_named_after_one_timeout(ray, members):
    """Asked where they keep weights, three silent workers are named together (the old loop
    stopped at the first), after one timeout."""
    timeout_s = 5.0
    handles = _with_modes(ray, members, "silent", "silent", "silent")
    sender = WeightBroadcaster(timeout_s=timeout_s, address="127.0.0.1")
    started = time.monotonic()
    with pytest.raises(WeightGroupError) as err:
        sender.form(ray, handles, dict.fromkeys(handles, "x"), CPU)
    elapsed = time.monotonic() - started
    assert "workers 0, 1, 2 did not say where they keep weights within 5 s" in str(err.value)
    assert "\n" not in str(err.value)
    assert timeout_s <= elapsed < 3 * timeout_s  # one wait each would be 3 x 5 s


def test_join_answers_are_waited_for_together(ray, members):
    """Three silent workers cost one wait, not three (the old loop waited a worker at a
    time: 12 s here)."""
    handles = _with_modes(ray, members, "silent", "silent", "silent", "joins")
    refs = {w: h.weights_device.remote() for w, h in handles.items()}
    started = time.monotonic()
    answers = broadcaster_module._join_failures(ray, refs, 4.0)
    assert time.monotonic() - started < 12.0  # one wait each would be 3 x 4 s
    assert answers == ("worker 0: no answer; worker 1: no answer; worker 2: no answer; "
                       "worker 3: ('cpu', '')")  # any answer but '' names a failure


def test_a_dead_worker_is_left_out_and_a_group_of_none_says_why_it_sent_nothing(ray, members):
    handles = _with_modes(ray, members, "joins")
    dead = ray.remote(Member).options(num_cpus=0).remote()
    ray.get(dead.set_mode.remote("joins"), timeout=900)  # loose: the test took 140 s at load 9
    _kill(ray, dead)
    sender = WeightBroadcaster(timeout_s=30, address="127.0.0.1")
    try:
        assert sender._devices(ray, {0: handles[0], 1: dead}) == {0: ("cpu", "")}
        sender.form(ray, {1: dead}, {1: "x"}, CPU)  # every worker down: no group
        assert sender.group is None
        assert not sender.send(4, {"w": torch.ones(2)}, lambda ref: None)
        assert sender.failure == NO_MEMBERS and "no worker to send to" in NO_MEMBERS
        sender.form(ray, {}, {}, CPU)  # none handed over at all: the same
        assert not sender.send(5, {"w": torch.ones(2)}, lambda ref: None)
        assert sender.failure == NO_MEMBERS
    finally:
        sender.close()
