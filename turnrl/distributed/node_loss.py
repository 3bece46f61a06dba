"""How long the learner waits for a rollout worker that fails every call (its node lost)
before giving it up: ``ray.node_loss_wait_s`` as set, or (-1, the default) a multiple of the
workers' start-up measured in this run (``StartupClock``: each worker's first answer); and
``Outages``, the learner's books of the workers failing calls, given up and revived.
"""

from __future__ import annotations

import time

from turnrl.distributed.fired import first_line

STARTUP_MULTIPLE = 3.0
"""``ray.node_loss_wait_s`` auto: this many times the slowest worker start-up measured. A
restart after a node loss costs more than the start it is measured on: Ray first notices
the node is gone (its health checks: 15-30 s), then starts a process on a node whose page
cache is cold (torch, the model files) while the learner and the other workers keep the
cores busy; a SmolLM2 restart on the busy 2-core machine took 155 s."""
REVIVE_EVERY_S = 5.0
"""How often the learner looks for room to revive a given-up worker."""
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


class Outages:
    """Which workers fail every call and since when, when each is tried again, which are
    given up (``dead``), and when a given-up one may be revived: ``Fleet`` (fleet.py) owns
    the actors and moves their work; this keeps the books and says what was lost."""

    def __init__(self, ray, clock: StartupClock, needs: dict | None = None,
                 has_room=None) -> None:
        self.ray = ray
        self.clock = clock
        """The workers' start-ups, and the wait they give (``ray.node_loss_wait_s``)."""
        self.needs = needs or {}
        """Resources one worker reserves, named when none is left to restart it on."""
        self.has_room = has_room or self.free_for_one
        """``has_room(w)``: whether the cluster could start worker ``w`` now."""
        self.down_since: dict[int, float] = {}
        self.retry_at: dict[int, float] = {}
        self.failures: dict[int, int] = {}
        self.dead: set[int] = set()
        self.revive_at = 0.0
        self.revivals: dict[int, int] = {}
        self.revived: set[int] = set()
        """Revived workers whose first report has not come in (they get a share then)."""

    @property
    def wait_s(self) -> float:
        """How long a worker may fail every call before it is given up."""
        return self.clock.wait_s

    def failed(self, w: int) -> bool:
        """A call to ``w`` failed: it is tried again after a backoff; True (and ``w`` given
        up) once it has failed every call for ``wait_s``."""
        now = time.monotonic()
        self.failures[w] = self.failures.get(w, 0) + 1
        since = self.down_since.setdefault(w, now)
        self.retry_at[w] = now + min(2.0, 0.1 * 2 ** self.failures[w])
        if now - since < self.wait_s:
            return False
        self.dead.add(w)
        return True

    def answered(self, w: int) -> None:
        """``w`` reported: it is up."""
        self.down_since.pop(w, None)
        self.failures.pop(w, None)

    def revival_due(self) -> bool:
        """Whether to look for room for the given-up workers now (every ``REVIVE_EVERY_S``)."""
        now = time.monotonic()
        if not self.dead or now < self.revive_at:
            return False
        self.revive_at = now + REVIVE_EVERY_S
        return True

    def reviving(self, w: int) -> int:
        """Given-up worker ``w`` is started afresh: its count of revivals."""
        self.revivals[w] = self.revivals.get(w, 0) + 1
        return self.revivals[w]

    def revived_one(self, w: int) -> None:
        """``w``'s fresh actor was created: no longer given up, its failures forgotten."""
        self.dead.discard(w)
        self.revived.add(w)
        for books in (self.down_since, self.failures, self.retry_at):
            books.pop(w, None)

    def free_for_one(self, w: int) -> bool:
        """Whether the cluster's free resources hold one worker's (``needs``)."""
        try:
            free = self.ray.available_resources()
        except Exception:  # noqa: BLE001 - the cluster is going
            return False
        return all(free.get(k, 0.0) >= v for k, v in self.needs.items() if v > 0)

    def describe(self, workers: list[int], node: dict[int, tuple[str, str]],
                 err: Exception) -> str:
        """The workers lost, the nodes they ran on (``node``: dead or not), what a restart
        needs."""
        try:
            nodes = {n["NodeID"]: n for n in self.ray.nodes()}
            free = self.ray.available_resources()
        except Exception:  # noqa: BLE001 - the cluster itself is gone
            nodes, free = {}, {}
        parts = []
        for w in workers:
            node_id, label = node.get(w, ("", "an unknown node"))
            state = "dead" if node_id in nodes and not nodes[node_id]["Alive"] else "alive"
            parts.append(f"worker {w} on {label}, node {state}")
        dead = [f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})" for n in nodes.values()
                if not n["Alive"]]
        missing = {k: v for k, v in self.needs.items() if v > 0 and free.get(k, 0.0) < v}
        need = ", ".join(f"{k} {v:g} (free {free.get(k, 0.0):g})" for k, v in missing.items())
        wait = f"{round(self.wait_s, 1):g} s ({self.clock.reason()})"
        return (f"{'; '.join(parts)} failed every call for {wait}; dead nodes: "
                f"{', '.join(dead) or 'none'}; a restart needs {need or 'nothing missing now'}: "
                f"add a node with those resources (`ray status`); the last error: "
                f"{first_line(err)}")
