"""The rollout workers seen from the learner: handles, in-flight polls, restarts, lost work.

``Fleet`` owns every call to the Ray actors (turnrl/distributed/workers.py) and reconciles
what each worker reports with the ``AssignmentBook``: a restarted worker (new incarnation)
gets the newest weights again and the assignments it lost, with the same ids and seeds; a
worker failing every call for the node-loss wait (node_loss.py) is given up (killed) and its
work moved; once the cluster has room for it again, a fresh actor takes its place (``revive``).
Its collaborators: ``WeightPublisher`` (publisher.py: the newest version and how it travels),
``Outages`` (node_loss.py: failing, given-up and revived workers) and ``FiredCalls``
(fired.py: calls whose answers are only checked for failures).
"""

from __future__ import annotations

import logging
import time

import torch

from turnrl.distributed.book import (
    Assignment,
    AssignmentBook,
    shared_out,
)
from turnrl.distributed.fired import FiredCalls
from turnrl.distributed.node_loss import Outages, StartupClock
from turnrl.distributed.pool_state import pool_message
from turnrl.distributed.publisher import WeightPublisher, group_members

POLL_WAIT_S = 0.1
"""How long a worker's ``take_groups`` waits for a group before answering empty."""
log = logging.getLogger("turnrl.worker")


class Fleet:
    """The worker handles, their in-flight polls, and what the learner knows of each."""

    def __init__(self, handles: list, book: AssignmentBook,
                 down_after_s: float | None = None, needs: dict | None = None,
                 respawn=None, has_room=None, broadcaster=None):
        import ray

        self.ray = ray
        self.handles = handles
        self.book = book
        self.seq = 0
        """Counts calls sent to workers. Ray runs one caller's calls to an actor in order, so
        an assignment sent before a poll was sent is known to the worker when it answers."""
        self.polls: dict[int, tuple[object, int]] = {}
        self.incarnation: dict[int, str] = {}
        self.version: dict[int, int] = {}
        self.weights_seq: dict[int, int] = {}
        self.weights = WeightPublisher(ray, broadcaster)
        self.outages = Outages(ray, StartupClock(down_after_s), needs, has_room)
        self.fired = FiredCalls(ray)
        # Events since the learner last looked (it logs them per step).
        self.restarts = 0
        self.reissued: list[int] = []
        self.stats: dict[int, dict] = {}
        self.pool_size: int | None = None
        """Live episodes per worker set by ``resize`` (None: as spawned)."""
        self.node: dict[int, tuple[str, str]] = {}
        """(node id, 'host (ip)') each worker last reported from."""
        self.respawn = respawn
        """``respawn(w, n)``: a fresh actor for given-up worker ``w`` (its ``n``-th revival)."""
        self.pool: list[tuple[int, object]] = []
        """The opponent pool's (version, ObjectRef of its weights): sent with the weights."""
        self.pool_draws: dict[int, int] = {}
        """Games each worker's pool has drawn, as last reported: a worker that is sent the
        pool again (restarted, revived, a resumed run) goes on counting from there."""
        self.starting: dict[int, object] = {}  # worker -> its first ping (time_startups)

    def time_startups(self) -> None:
        """Time every worker's start-up (``StartupClock``): called as they are created."""
        self.starting = {w: self.outages.clock.watch(h.ping.remote())
                         for w, h in enumerate(self.handles)}

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _call(self, w: int, method: str, *args) -> None:
        """``method(*args)`` on worker ``w``, fired (``FiredCalls``)."""
        self.fired.fire(getattr(self.handles[w], method).remote(*args), w, method)

    def up(self) -> list[int]:
        return [w for w in range(len(self.handles))
                if w not in self.outages.dead and w not in self.outages.down_since]

    def alive(self) -> list[int]:
        return [w for w in range(len(self.handles)) if w not in self.outages.dead]

    def wait_started(self, timeout_s: float) -> None:
        """Block until every worker has built its model (a constructor error raises here)."""
        refs = [self.starting.get(w) or h.ping.remote() for w, h in enumerate(self.handles)]
        try:
            incarnations = self.ray.get(refs, timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the rollout workers did not start within {timeout_s:.0f} s; does the cluster "
                "have the CPUs/GPUs they reserve (ray.worker_cpus, ray.worker_gpus) free? "
                "see `ray status`") from None
        for w, incarnation in enumerate(incarnations):
            self.incarnation[w] = incarnation
        if self.weights.broadcaster is not None:  # a group that cannot form stops the run here
            self.weights.form(self.handles, group_members(self.up(), self.incarnation))

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """``version`` to every worker: through the weight group to its members, through the
        object store to the rest."""
        self.weights.publish(version, model)
        members = self.weights.broadcast(version, self.handles,
                                         group_members(self.up(), self.incarnation),
                                         self.fired.fire)
        for w in members:
            self.weights_seq[w] = self._next_seq()
        for w in self.alive():
            if w not in members:
                self.send_weights(w)

    def send_weights(self, w: int) -> None:
        version, ref = self.weights.newest[0], self.weights.ref()
        self._call(w, "set_weights", version, [ref])
        self.weights_seq[w] = self._next_seq()
        if self.pool:  # a restarted or revived worker gets the pool back with the weights
            self._call(w, "set_pool", *pool_message(self.pool, self.pool_draws.get(w, 0)))

    def set_pool(self, versions: list[int]) -> None:
        """The opponent pool is now ``versions``, each a published version (the newest is
        the one just published): every worker holds the same frozen copies."""
        refs = dict(self.pool)
        refs[self.weights.newest[0]] = self.weights.ref()
        self.seed_pool([(v, refs[v]) for v in versions])

    def seed_pool(self, members: list[tuple[int, object]]) -> None:
        """The opponent pool is ``members`` ((version, ObjectRef of its weights) each): sent
        to every worker (a resumed run: the checkpoint's pool, before the first game)."""
        self.pool = list(members)
        for w in self.alive():
            self._call(w, "set_pool", *pool_message(self.pool, self.pool_draws.get(w, 0)))

    def resize(self, pool_size: int) -> None:
        """Every worker's pool to ``pool_size`` live episodes (a restarted one gets it too)."""
        self.pool_size = pool_size
        for w in self.alive():
            self._call(w, "resize", pool_size)

    def assign(self, w: int, assignments: list[Assignment]) -> None:
        self._call(w, "assign", [(a.id, a.seed, a.plan) for a in assignments])

    def revive(self) -> None:
        """Start a fresh actor for each given-up worker the cluster has room for again (a node
        came back); it gets the newest weights and the pool size, then work as any other."""
        outages = self.outages
        if self.respawn is None or not outages.revival_due():
            return
        for w in sorted(outages.dead):
            if not outages.has_room(w):
                return
            self.handles[w] = self.respawn(w, outages.reviving(w))
            self.starting[w] = outages.clock.watch(self.handles[w].ping.remote())
            outages.revived_one(w)
            self.incarnation.pop(w, None)  # its first report sets the incarnation
            log.warning("rollout worker %d revived: the cluster has room for it again", w)
            if self.pool_size is not None:
                self._call(w, "resize", self.pool_size)
            if self.weights.newest:
                self.send_weights(w)

    def poll(self, timeout_s: float) -> list[tuple[int, int, object]]:
        """Reports that arrived within ``timeout_s``: ``(worker, poll seq, WorkerReport)``."""
        self.revive()
        self.fired.check()
        now = time.monotonic()
        for w in self.alive():
            if w not in self.polls and now >= self.outages.retry_at.get(w, 0.0):
                ref = self.handles[w].take_groups.remote(None, POLL_WAIT_S)
                self.polls[w] = (ref, self._next_seq())
        if not self.polls:
            time.sleep(timeout_s)
            return []
        refs = [ref for ref, _ in self.polls.values()]
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        ready = set(ready)
        reports = []
        for w, (ref, seq) in list(self.polls.items()):
            if ref not in ready:
                continue
            del self.polls[w]
            try:
                reports.append((w, seq, self.ray.get(ref)))
            except self.ray.exceptions.RayActorError as err:
                self._failed(w, err)
        return reports

    def _failed(self, w: int, err: Exception) -> None:
        if not self.outages.failed(w):
            return
        # given up: killed, its assignments go to the workers still alive
        self.polls.pop(w, None)
        _kill(self.ray, self.handles[w])
        others = self.up() or self.alive()
        lost = self.outages.describe(sorted(self.outages.dead), self.node, err)
        if not others:
            raise RuntimeError(f"every rollout worker is down: {lost}") from err
        log.warning("rollout worker %d given up: %s", w, lost)
        for i, assignment in enumerate(self.book.at(w)):
            target = others[i % len(others)]
            self.book.move(assignment, target, self._next_seq())
            self.assign(target, [assignment])
            self.reissued.append(assignment.id)

    def reconcile(self, w: int, seq: int, report) -> None:
        """Bring a worker up to date after its report: restarts, lost weights, lost work."""
        self.outages.answered(w)
        if getattr(report, "node", None):
            self.node[w] = report.node
        for line in getattr(report, "logs", ()):
            log.warning("[worker %d @ %s] %s", w, self.node.get(w, ("", "?"))[1], line)
        if self.incarnation.get(w, report.incarnation) != report.incarnation:
            self.restarts += 1
            if self.pool_size is not None:
                self._call(w, "resize", self.pool_size)
        self.incarnation[w] = report.incarnation
        self.version[w] = report.version
        self.weights.count_pull(self.node.get(w, (f"worker-{w}", f"worker {w}")),
                                report.version)
        self.stats[w] = report.stats
        draws = getattr(report, "pool_draws", 0)
        if draws > self.pool_draws.get(w, 0):
            self.pool_draws[w] = draws
        newest = self.weights.newest
        if newest and report.weights_version < newest[0] and self.weights_seq.get(w, seq) < seq:
            self.send_weights(w)  # sent before this poll, yet missing: lost in a restart
        known = report.known | {g.assignment for g in report.groups}
        lost = self.book.lost(w, known, seq)
        if lost:  # re-issued with the same ids and seeds, after the weights
            resend = self._next_seq()
            for assignment in lost:
                self.book.move(assignment, w, resend)
                self.reissued.append(assignment.id)
            self.assign(w, lost)
        if w in self.outages.revived:  # up (its model built): its share of the work moved away
            self.outages.revived.discard(w)
            self.share(w)

    def share(self, w: int) -> None:
        """Move to worker ``w`` the newest assignments of the busiest workers that answer,
        up to an even share: a given-up worker's work went to the others, and new work alone
        reached its revived actor only as their queues drained (with more queued than the
        run's remaining steps, never). The newest are the likeliest still queued, and those
        are withdrawn; one already in play is played twice, and its first delivery counts."""
        moved = shared_out(self.book, w, [o for o in self.up() if o != w])
        if not moved:
            return
        seq = self._next_seq()
        for donor, assignments in moved.items():
            self._call(donor, "withdraw", [a.id for a in assignments])
            for assignment in assignments:
                self.book.move(assignment, w, seq)
                self.reissued.append(assignment.id)
        self.assign(w, [a for assignments in moved.values() for a in assignments])
        log.warning("rollout worker %d takes %d queued groups from workers %s", w,
                    sum(map(len, moved.values())), ", ".join(map(str, sorted(moved))))

    def take_pulled(self) -> dict[str, int]:
        """Weight bytes pulled per node since the last call (each node that has workers)."""
        return self.weights.take_pulled(
            {f"{label} {node_id[:8]}" for node_id, label in
             (self.node.get(w, ("", "")) for w in self.alive()) if node_id})

    def shutdown(self) -> None:
        self.weights.close()
        for handle in self.handles:
            _kill(self.ray, handle)


def _kill(ray, handle) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
