"""The rollout workers seen from the learner: handles, in-flight polls, restarts, lost work.

``Fleet`` owns every call to the Ray actors (turnrl/distributed/workers.py) and reconciles
what each worker reports with the ``AssignmentBook``: a restarted worker (new incarnation)
gets the newest weights again and the assignments it lost, with the same ids and seeds; a
worker failing every call for ``down_after_s`` (node_loss.py) is given up (killed) and its
work moved; once the cluster has room for it again, a fresh actor takes its place (``revive``).
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
from turnrl.distributed.node_loss import StartupClock
from turnrl.distributed.worker_engines import without_tied_weights
from turnrl.lora import published_state, state_bytes

POLL_WAIT_S = 0.1
"""How long a worker's ``take_groups`` waits for a group before answering empty."""
REVIVE_EVERY_S = 5.0
"""How often the learner looks for room to revive a given-up worker."""
FORM_TRIES = 3
"""Mid-run, the weight group may fail to form this many times in a row before the run gives
it up and uses the object store alone."""
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
        self.down_since: dict[int, float] = {}
        self.retry_at: dict[int, float] = {}
        self.failures: dict[int, int] = {}
        self.dead: set[int] = set()
        self.weights: tuple[int, object] | None = None
        self.version_bytes = 0
        """Tensor bytes of the newest published version (a LoRA run: the adapter's)."""
        self.fired: list[tuple[object, int | None, str]] = []
        """(ref, worker, method) of calls whose answer is never needed, until checked."""
        # Events since the learner last looked (it logs them per step).
        self.restarts = 0
        self.reissued: list[int] = []
        self.stats: dict[int, dict] = {}
        self.pool_size: int | None = None
        """Live episodes per worker set by ``resize`` (None: as spawned)."""
        self.clock = StartupClock(down_after_s)
        """The workers' start-ups, and the wait they give (``ray.node_loss_wait_s``)."""
        self.needs = needs or {}
        """Resources one worker reserves, named when none is left to restart it on."""
        self.node: dict[int, tuple[str, str]] = {}
        """(node id, 'host (ip)') each worker last reported from."""
        self.respawn = respawn
        """``respawn(w, n)``: a fresh actor for given-up worker ``w`` (its ``n``-th revival)."""
        self.has_room = has_room or self._free_for_one
        """``has_room(w)``: whether the cluster could start worker ``w`` now."""
        self.revive_at = 0.0
        self.revivals: dict[int, int] = {}
        self.revived: set[int] = set()
        """Revived workers whose first report has not come in (they get a share then)."""
        self.published_bytes: dict[int, int] = {}
        """Version -> bytes of its published state dict (the last few versions)."""
        self.node_versions: dict[str, set[int]] = {}
        """Node id -> the versions its workers have loaded: Ray pulls an object into a node's
        store once, and every worker there reads that copy."""
        self.pulled: dict[str, int] = {}
        """Node label -> weight bytes pulled to it since the learner last looked."""
        self.pool: list[tuple[int, object]] = []
        """The opponent pool's (version, ObjectRef of its weights): sent with the weights."""
        self.pool_draws: dict[int, int] = {}
        """Games each worker's pool has drawn, as last reported: a worker that is sent the
        pool again (restarted, revived, a resumed run) goes on counting from there."""
        self.broadcaster = broadcaster
        """``ray.weight_sync: broadcast``: the learner's side of the weight group (None: the
        object store carries every version). Formed once the workers have started."""
        self.form_failures = 0
        """Failed formations in a row mid-run; ``FORM_TRIES`` of them end broadcasting."""
        self.broadcast_versions: list[int] = []
        """Versions that went through the weight group (the rest: the object store)."""
        self.state: dict | None = None
        self.learner_device = torch.device("cpu")
        self.starting: dict[int, object] = {}  # worker -> its first ping (time_startups)

    @property
    def down_after_s(self) -> float:
        """How long a worker may fail every call before it is given up."""
        return self.clock.wait_s

    def time_startups(self) -> None:
        """Time every worker's start-up (``StartupClock``): called as they are created."""
        self.starting = {w: self.clock.watch(h.ping.remote()) for w, h in enumerate(self.handles)}

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _fire(self, ref, worker: int | None = None, method: str = "") -> None:
        """A call whose answer we never need; kept so that a failure is seen at the next
        ``poll`` (``check_fired``) and named with ``worker`` and ``method``."""
        self.fired.append((ref, worker, method))

    def _call(self, w: int, method: str, *args) -> None:
        """``method(*args)`` on worker ``w``, fired (``_fire``)."""
        self._fire(getattr(self.handles[w], method).remote(*args), w, method)

    def check_fired(self) -> None:
        """The fired calls that have finished (never waits): an actor that died is left to
        the poll path; a method that raised is one line naming the worker, the method and
        the cause. A failed ``set_pool`` raises (that worker's games would all fail without
        their opponents); any other is logged, as the books repair it: weights missing at
        the next report are sent again, an assignment that never arrived is re-issued, a
        withdrawal that failed leaves a group played twice (its first delivery counts), a
        resize that failed leaves the worker's pool at its old size. Any other Ray error (a
        lost object, a cancelled call) is logged the same way."""
        if not self.fired:
            return
        refs = [ref for ref, _, _ in self.fired]
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        if not done:
            return
        finished = set(done)
        calls = [call for call in self.fired if call[0] in finished]
        self.fired = [call for call in self.fired if call[0] not in finished]
        for ref, worker, method in calls:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                pass  # the poll path notices dead workers
            except self.ray.exceptions.RayTaskError as err:
                line = fired_failure(worker, method, err)
                if method == "set_pool":
                    raise RuntimeError(line) from None
                log.warning("%s", line)
            except self.ray.exceptions.RayError as err:  # lost object, cancelled call...
                log.warning("%s", fired_failure(worker, method, err))

    def up(self) -> list[int]:
        return [w for w in range(len(self.handles))
                if w not in self.dead and w not in self.down_since]

    def alive(self) -> list[int]:
        return [w for w in range(len(self.handles)) if w not in self.dead]

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
        if self.broadcaster is not None:  # a group that cannot form stops the run here
            self._form_group()

    def _group_members(self) -> dict[int, str]:
        """The workers the weight group should hold now: up, with a known incarnation."""
        return {w: self.incarnation[w] for w in self.up() if w in self.incarnation}

    def _form_group(self) -> None:
        members = self._group_members()
        self.broadcaster.form(self.ray, {w: self.handles[w] for w in members}, members,
                              self.learner_device)

    def publish(self, version: int, model: torch.nn.Module) -> None:
        # Tied tensors are found on the model's device (copies to the CPU no longer alias).
        # LoRA: the adapter's tensors alone (``published_state``), a fraction of the model.
        state = without_tied_weights(published_state(model))
        self.learner_device = next(model.parameters()).device
        self.version_bytes = state_bytes(state)
        self.published_bytes[version] = state_bytes(state)
        for old in [v for v in self.published_bytes if v < version - 16]:
            del self.published_bytes[old]
        # The live tensors, put in the object store only if a worker outside the group needs
        # this version: the learner's loop (publish, collect, update) leaves them unchanged
        # until the next publish, and every catch-up happens while collecting.
        self.state, self.weights = state, (version, None)
        members = self._broadcast(version, state)
        for w in self.alive():
            if w not in members:
                self.send_weights(w)

    def _broadcast(self, version: int, state: dict) -> set[int]:
        """Send ``version`` through the weight group, formed again first when its members
        changed; the workers it reached (none: the object store carries it)."""
        broadcaster = self.broadcaster
        if broadcaster is None or broadcaster.generation == 0:
            return set()  # object store mode, or the start version while the workers build
        if broadcaster.members != self._group_members():
            try:
                self._form_group()
                self.form_failures = 0
            except RuntimeError as err:
                self.form_failures += 1
                if self.form_failures < FORM_TRIES:
                    log.warning("%s; version %d goes through the object store", err, version)
                    return set()
                log.warning("%s; the object store carries every version from now on", err)
                self.broadcaster = None
                return set()
        if not broadcaster.send(version, state, self._fire):
            log.warning("the broadcast of version %d failed (%s): it goes through the object "
                        "store; the weight group forms again at the next version",
                        version, broadcaster.failure)
            return set()
        self.broadcast_versions.append(version)
        for w in broadcaster.members:
            self.weights_seq[w] = self._next_seq()
        return set(broadcaster.members)

    def weights_ref(self) -> object:
        """The newest version in the object store, put there once for all who need it (a
        worker outside the weight group, the opponent pool)."""
        version, ref = self.weights
        if ref is None:
            cpu = {k: v.to("cpu") if torch.is_tensor(v) else v for k, v in self.state.items()}
            ref = self.ray.put(cpu)
            self.weights = (version, ref)
        return ref

    def send_weights(self, w: int) -> None:
        version, ref = self.weights[0], self.weights_ref()
        self._call(w, "set_weights", version, [ref])
        self.weights_seq[w] = self._next_seq()
        if self.pool:  # a restarted or revived worker gets the pool back with the weights
            self.send_pool(w)

    def send_pool(self, w: int) -> None:
        """The pool to worker ``w``, with its count of games drawn when one was reported."""
        members = [(v, [r]) for v, r in self.pool]
        draws = self.pool_draws.get(w, 0)
        self._call(w, "set_pool", *([members, draws] if draws else [members]))

    def set_pool(self, versions: list[int]) -> None:
        """The opponent pool is now ``versions``, each a published version (the newest is
        the one just published): every worker holds the same frozen copies."""
        refs = dict(self.pool)
        refs[self.weights[0]] = self.weights_ref()
        self.seed_pool([(v, refs[v]) for v in versions])

    def seed_pool(self, members: list[tuple[int, object]]) -> None:
        """The opponent pool is ``members`` ((version, ObjectRef of its weights) each): sent
        to every worker (a resumed run: the checkpoint's pool, before the first game)."""
        self.pool = list(members)
        for w in self.alive():
            self.send_pool(w)

    def resize(self, pool_size: int) -> None:
        """Every worker's pool to ``pool_size`` live episodes (a restarted one gets it too)."""
        self.pool_size = pool_size
        for w in self.alive():
            self._call(w, "resize", pool_size)

    def assign(self, w: int, assignments: list[Assignment]) -> None:
        self._call(w, "assign", [(a.id, a.seed) for a in assignments])

    def revive(self) -> None:
        """Start a fresh actor for each given-up worker the cluster has room for again (a node
        came back); it gets the newest weights and the pool size, then work as any other."""
        now = time.monotonic()
        if not self.dead or self.respawn is None or now < self.revive_at:
            return
        self.revive_at = now + REVIVE_EVERY_S
        for w in sorted(self.dead):
            if not self.has_room(w):
                return
            self.revivals[w] = self.revivals.get(w, 0) + 1
            self.handles[w] = self.respawn(w, self.revivals[w])
            self.starting[w] = self.clock.watch(self.handles[w].ping.remote())
            self.dead.discard(w)
            self.revived.add(w)
            for books in (self.down_since, self.failures, self.retry_at, self.incarnation):
                books.pop(w, None)  # its first report sets the incarnation
            log.warning("rollout worker %d revived: the cluster has room for it again", w)
            if self.pool_size is not None:
                self._call(w, "resize", self.pool_size)
            if self.weights:
                self.send_weights(w)

    def _free_for_one(self, w: int) -> bool:
        """Whether the cluster's free resources hold one worker's (``needs``)."""
        try:
            free = self.ray.available_resources()
        except Exception:  # noqa: BLE001 - the cluster is going
            return False
        return all(free.get(k, 0.0) >= v for k, v in self.needs.items() if v > 0)

    def poll(self, timeout_s: float) -> list[tuple[int, int, object]]:
        """Reports that arrived within ``timeout_s``: ``(worker, poll seq, WorkerReport)``."""
        self.revive()
        self.check_fired()
        now = time.monotonic()
        for w in self.alive():
            if w not in self.polls and now >= self.retry_at.get(w, 0.0):
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
        now = time.monotonic()
        self.failures[w] = self.failures.get(w, 0) + 1
        since = self.down_since.setdefault(w, now)
        self.retry_at[w] = now + min(2.0, 0.1 * 2 ** self.failures[w])
        if now - since < self.down_after_s:
            return
        self.dead.add(w)  # given up: killed, its assignments go to the workers still alive
        self.polls.pop(w, None)
        self._kill(w)
        others = self.up() or self.alive()
        lost = self.describe_loss(sorted(self.dead), err)
        if not others:
            raise RuntimeError(f"every rollout worker is down: {lost}") from err
        log.warning("rollout worker %d given up: %s", w, lost)
        for i, assignment in enumerate(self.book.at(w)):
            target = others[i % len(others)]
            self.book.move(assignment, target, self._next_seq())
            self.assign(target, [assignment])
            self.reissued.append(assignment.id)

    def _kill(self, w: int) -> None:
        try:
            self.ray.kill(self.handles[w], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def describe_loss(self, workers: list[int], err: Exception) -> str:
        """The workers lost, the nodes they ran on (dead or not), what a restart needs."""
        try:
            nodes = {n["NodeID"]: n for n in self.ray.nodes()}
            free = self.ray.available_resources()
        except Exception:  # noqa: BLE001 - the cluster itself is gone
            nodes, free = {}, {}
        parts = []
        for w in workers:
            node_id, label = self.node.get(w, ("", "an unknown node"))
            state = "dead" if node_id in nodes and not nodes[node_id]["Alive"] else "alive"
            parts.append(f"worker {w} on {label}, node {state}")
        dead = [f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})" for n in nodes.values()
                if not n["Alive"]]
        missing = {k: v for k, v in self.needs.items() if v > 0 and free.get(k, 0.0) < v}
        need = ", ".join(f"{k} {v:g} (free {free.get(k, 0.0):g})" for k, v in missing.items())
        wait = f"{round(self.down_after_s, 1):g} s ({self.clock.reason()})"
        return (f"{'; '.join(parts)} failed every call for {wait}; dead nodes: "
                f"{', '.join(dead) or 'none'}; a restart needs {need or 'nothing missing now'}: add a node with those "
                f"resources (`ray status`); the last error: {_first_line(err)}")

    def reconcile(self, w: int, seq: int, report) -> None:
        """Bring a worker up to date after its report: restarts, lost weights, lost work."""
        self.down_since.pop(w, None)
        if getattr(report, "node", None):
            self.node[w] = report.node
        for line in getattr(report, "logs", ()):
            log.warning("[worker %d @ %s] %s", w, self.node.get(w, ("", "?"))[1], line)
        self.failures.pop(w, None)
        if self.incarnation.get(w, report.incarnation) != report.incarnation:
            self.restarts += 1
            if self.pool_size is not None:
                self._call(w, "resize", self.pool_size)
        self.incarnation[w] = report.incarnation
        self.version[w] = report.version
        self._count_pull(w, report.version)
        self.stats[w] = report.stats
        draws = getattr(report, "pool_draws", 0)
        if draws > self.pool_draws.get(w, 0):
            self.pool_draws[w] = draws
        if self.weights and report.weights_version < self.weights[0] \
                and self.weights_seq.get(w, seq) < seq:
            self.send_weights(w)  # sent before this poll, yet missing: lost in a restart
        known = report.known | {g.assignment for g in report.groups}
        lost = self.book.lost(w, known, seq)
        if lost:  # re-issued with the same ids and seeds, after the weights
            resend = self._next_seq()
            for assignment in lost:
                self.book.move(assignment, w, resend)
                self.reissued.append(assignment.id)
            self.assign(w, lost)
        if w in self.revived:  # up (its model built): its share of the work moved away
            self.revived.discard(w)
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

    def _count_pull(self, w: int, version: int) -> None:
        """Weight bytes pulled to worker ``w``'s node: a version's first load on that node."""
        node_id, label = self.node.get(w, (f"worker-{w}", f"worker {w}"))
        seen = self.node_versions.setdefault(node_id, set())
        if version in seen or version not in self.published_bytes \
                or version in self.broadcast_versions[-32:]:  # not through the object store
            return
        seen.add(version)
        seen.difference_update([v for v in seen if v not in self.published_bytes])
        self.pulled[f"{label} {node_id[:8]}"] = (self.pulled.get(f"{label} {node_id[:8]}", 0)
                                                  + self.published_bytes[version])

    def take_pulled(self) -> dict[str, int]:
        """Weight bytes pulled per node since the last call (each node that has workers)."""
        nodes = {f"{label} {node_id[:8]}" for node_id, label in
                 (self.node.get(w, ("", "")) for w in self.alive()) if node_id}
        pulled = {node: self.pulled.get(node, 0) for node in nodes | set(self.pulled)}
        self.pulled = {}
        return pulled

    def shutdown(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()
        for handle in self.handles:
            try:
                self.ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


def fired_failure(worker: int | None, method: str, err: Exception) -> str:
    """One line for a fired call that raised: the worker, the method, the cause. Calls fired
    for another module (the weight group's ``receive_weights``) carry no worker; the error
    then names the method."""
    method = method or getattr(err, "function_name", "") or "a call"
    who = f"rollout worker {worker}" if worker is not None else "a rollout worker"
    cause = getattr(err, "cause", None) or err
    return (f"{who}: {method.rsplit('.', 1)[-1]} failed: {type(cause).__name__}: "
            f"{_first_line(cause)}")


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__
