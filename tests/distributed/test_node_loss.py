"""ray.node_loss_wait_s follows the workers' start-up measured in this run: the pure rule
(node_loss.py), the fleet timing its real Ray actors' start-ups (at spawn and at a revival),
and the wait it gives up a failing worker after. docs/cluster.md "Node loss"."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest

from tests.conftest import local_ray
from turnrl.config import ConfigError, load_config
from turnrl.distributed import node_loss
from turnrl.distributed.book import AssignmentBook
from turnrl.distributed.node_loss import node_loss_wait, wait_reason


def test_the_wait_is_a_multiple_of_the_start_up_within_its_bounds():
    low, high = node_loss.NODE_LOSS_WAIT_S
    multiple = node_loss.STARTUP_MULTIPLE
    assert node_loss_wait(None) == low  # nothing measured yet: the lower bound
    assert node_loss_wait(5.0) == low  # a fast start (the tiny model) keeps the old 120 s
    assert node_loss_wait(155.0) == pytest.approx(multiple * 155.0)  # slow start: 3x
    assert node_loss_wait(3600.0) == high
    assert node_loss_wait(low / multiple + 1) > low  # the bound is reached, not a step
    # a value the user set is used as is, measured or not
    assert node_loss_wait(155.0, 3.0) == 3.0 and node_loss_wait(None, 0.0) == 0.0
    assert wait_reason(155.0, None).startswith("ray.node_loss_wait_s auto: 3x the slowest")
    assert "155 s" in wait_reason(155.0, None)
    assert wait_reason(155.0, 3.0) == "ray.node_loss_wait_s"


def test_the_config_defaults_to_auto_and_refuses_other_negatives():
    assert load_config(None, []).ray.node_loss_wait_s == -1
    assert load_config(None, ["--ray.node_loss_wait_s", "30"]).ray.node_loss_wait_s == 30
    with pytest.raises(ConfigError, match="node_loss_wait_s must be -1 .auto"):
        load_config(None, ["--ray.node_loss_wait_s", "-5"])


@pytest.fixture(scope="module")
def ray_local():
    """A Ray cluster of this module's own (the fleet's calls reach Ray, even to give up)."""
    with local_ray(sys.modules[__name__]) as ray:
        yield ray


class _Silent:
    """A stand-in handle: every call is fired and forgotten (``remote`` returns None)."""

    def __getattr__(self, method):
        return SimpleNamespace(remote=lambda *args: None)


def test_a_failing_worker_is_given_up_after_the_wait_its_start_up_gives(ray_local):
    from turnrl.distributed.fleet import Fleet

    fleet = Fleet([_Silent(), _Silent()], AssignmentBook(lambda index: index))
    fleet.outages.clock.startups = [100.0]  # measured: 3x is 300 s, over the lower bound
    assert fleet.outages.wait_s == pytest.approx(300.0)
    fleet.outages.down_since[1] = time.monotonic() - 250.0  # down 250 s: not yet
    fleet._failed(1, RuntimeError("actor unavailable"))
    assert 1 not in fleet.outages.dead
    fleet.outages.down_since[1] = time.monotonic() - 310.0
    fleet._failed(1, RuntimeError("actor unavailable"))
    assert fleet.outages.dead == {1}
    given = Fleet([_Silent()], AssignmentBook(lambda index: index), down_after_s=3.0)
    given.outages.clock.startups = [100.0]
    assert given.outages.wait_s == 3.0  # the user's value wins


class SlowStart:
    """A Ray actor that takes ``seconds`` to construct, as a worker building its model."""

    def __init__(self, seconds: float):
        time.sleep(seconds)

    def ping(self) -> str:
        return "incarnation"


def _measured(fleet, count: int) -> float:
    """When the fleet has measured ``count`` start-ups (Ray's thread records one the moment
    the actor answers, whether or not the learner is looking)."""
    deadline = time.monotonic() + 120
    while len(fleet.outages.clock.startups) < count:
        assert time.monotonic() < deadline, "no start-up measured"
        time.sleep(0.02)
    return time.monotonic()


def test_the_fleet_measures_each_worker_start_up_from_its_creation(ray_local, monkeypatch):
    from turnrl.distributed.fleet import Fleet

    monkeypatch.setattr(node_loss, "NODE_LOSS_WAIT_S", (0.0, 1e9))  # the multiple alone
    actor = ray_local.remote(SlowStart)
    created = time.monotonic()
    fleet = Fleet([actor.remote(1.0)], AssignmentBook(lambda index: index),
                  respawn=lambda w, n: actor.remote(2.5), has_room=lambda w: True)
    fleet.time_startups()  # as RaySource.open does, right after spawning
    seen = _measured(fleet, 1)
    assert 1.0 <= fleet.outages.clock.slowest <= seen - created
    startup = fleet.outages.clock.slowest
    time.sleep(1.0)  # the learner busy elsewhere (its evaluation) ...
    fleet.wait_started(timeout_s=120)  # ... looks later: the figure stays the answer's
    assert fleet.outages.clock.slowest == startup
    assert fleet.outages.wait_s == pytest.approx(node_loss.STARTUP_MULTIPLE * startup)
    fleet.outages.dead = {0}
    revived = time.monotonic()
    fleet.revive()  # a fresh actor, slower to start: the wait follows it
    seen = _measured(fleet, 2)
    assert 2.5 <= fleet.outages.clock.startups[1] <= seen - revived
    clock = fleet.outages.clock
    assert clock.slowest == max(clock.startups)  # the slowest start of the run
    assert fleet.outages.wait_s == pytest.approx(node_loss.STARTUP_MULTIPLE * clock.slowest)
