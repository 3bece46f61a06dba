"""How long the learner waits for a rollout worker that fails every call (its node lost)
before giving it up: ``ray.node_loss_wait_s`` as set, or (-1, the default) a multiple of the
workers' start-up measured in this run (``StartupClock``: each worker's first answer)."""

from __future__ import annotations

import time

STARTUP_MULTIPLE = 3.0
"""``ray.node_loss_wait_s`` auto: this many times the slowest worker start-up measured. A
restart after a node loss costs more than the start it is measured on: Ray first notices
the node is gone (its health checks: 15-30 s), then starts a process on a node whose page
cache is cold (torch, the model files) while the learner and the other workers keep the
cores busy; a SmolLM2 restart on the busy 2-core machine took 155 s."""
NODE_LOSS_WAIT_S = (120.0, 1800.0)
"""Bounds of the auto wait: at least the old fixed default (a fast-starting worker still gets
Ray's detection and a slow spell), at most 30 minutes (a worker that never returns is given
up, and a run with none left stops, within that)."""


def node_loss_wait(startup_s: float | None, given_s: float | None = None) -> float:
    """How long a worker failing every call is waited for before it is given up: ``given_s``
    (``ray.node_loss_wait_s`` set by the user) as is; else ``STARTUP_MULTIPLE`` times the
    slowest start-up measured, within ``NODE_LOSS_WAIT_S`` (the lower bound until one is)."""
    if given_s is not None:
        return given_s
    low, high = NODE_LOSS_WAIT_S
    return low if startup_s is None else min(high, max(low, STARTUP_MULTIPLE * startup_s))


def wait_reason(startup_s: float | None, given_s: float | None) -> str:
    """Where the wait came from, for the given-up line."""
    if given_s is not None:
        return "ray.node_loss_wait_s"
    measured = (f"{STARTUP_MULTIPLE:g}x the slowest worker start-up measured, {startup_s:.0f} s"
                if startup_s is not None else "no worker start-up measured yet")
    low, high = NODE_LOSS_WAIT_S
    return f"ray.node_loss_wait_s auto: {measured}, within {low:.0f}-{high:.0f} s"


class StartupClock:
    """The workers' start-ups measured in this run, and the node-loss wait they give.

    Each worker is pinged as it is created (at spawn, at a revival): Ray runs the call once
    the constructor has built the model, so the answer times the start-up (process, imports,
    model) on the learner's clock, recorded by Ray's thread the moment it comes, even while
    the learner is busy elsewhere (the evaluation before step 1)."""

    def __init__(self, given_s: float | None = None):
        self.given_s = given_s
        """``ray.node_loss_wait_s`` as the user set it (None: auto)."""
        self.startups: list[float] = []
        """Seconds of each start-up measured."""

    @property
    def slowest(self) -> float | None:
        return max(self.startups, default=None)

    @property
    def wait_s(self) -> float:
        return node_loss_wait(self.slowest, self.given_s)

    def reason(self) -> str:
        return wait_reason(self.slowest, self.given_s)

    def watch(self, ping):
        """Time the worker whose first ``ping`` (an ObjectRef) was just sent; ``ping``."""
        future = getattr(ping, "future", None)
        if callable(future):  # a Ray call (not a test's stand-in handle)
            created = time.monotonic()
            future().add_done_callback(lambda done: self._answered(created, done))
        return ping

    def _answered(self, created: float, done) -> None:
        if not done.cancelled() and done.exception() is None:  # a constructor error: not a start
            self.startups.append(time.monotonic() - created)
