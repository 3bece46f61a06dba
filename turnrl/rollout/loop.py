"""The one turn loop: it owns turn bookkeeping, env timeouts and episode ends, in every mode.

``TurnLoop`` keeps a *pool* of live episodes over one engine. The synchronous trainer and
evaluation run it to completion in lock-step (``run_episodes``: every turn waits for the
slowest environment step of the batch, which it needs whole anyway, and every live episode
is continued in one generate call, in the order the episodes were given, so a seeded run
samples the same tokens); the asynchronous trainer's rollout workers run it continuously:

- each iteration, every episode that is waiting for the policy is continued in ONE
  ``engine.generate`` call (a batch: the CPU/GPU cost of a decode step is nearly flat in the
  batch size), then each one's environment step is launched as its own asyncio task under
  the per-step timeout;
- episodes whose environment step is still running are not waited for: the next generate
  call takes whoever is ready (a slow tool call holds back its own episode, nobody else's);
  generation runs in a thread (in lock-step, where no env step runs beside it, on the loop's
  own), so environment steps keep running during it; when no episode
  waits for the policy the loop sleeps until an environment step ends (``BATCH_WINDOW_S``);
- before every generate call ``before_generate()`` lets the owner swap in newer weights and
  bump ``engine.version``; sampled tokens are tagged with the version that produced them, so
  with partial rollouts (APRIL: Zhou et al. 2025, arXiv:2509.18521) one episode can span
  several versions, and the learner's staleness filter looks at its *oldest* policy token;
- new episodes start from a seed feed (``submit``) whenever the pool has room for a group;
- finished episodes are handed out whole per GRPO *group* (``take_groups`` returns a
  ``Group`` once all its episodes have ended: the group-relative advantage needs them all).

This is the rollout half of AReaL's design (Fu et al. 2025, arXiv:2505.24298). Without
partial rollouts the pool is filled in waves, weights swapped only between them.

Environment calls run on each env's own thread (``env_calls.EnvRunner``) under
``env_timeout_s``, and what they return is checked: a blocking, raising, stuck or malformed
environment fails its own episode (status "timeout" or "error", the reason in ``info``) and
never stalls the loop; env text that cannot fit the context ends its episode before it is
rendered or tokenised (``input_bounds``). Envs that declare ``cooperative = True`` share one thread instead
(one that blocks anyway also holds up its loop-mates until their timeouts: ``EnvThreads``).
The turn rule (what a reset or step does to its episode) is ``TurnRule`` (turns.py);
multi-seat games (self-play: one env, one episode per seat) are played by the loop's
``Seats`` collaborator (seats.py).
Plain asyncio: a Ray ``RolloutWorker`` runs it in a thread; ``submit``,
``take_groups``, ``known_assignments`` and ``stop`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from turnrl import leftovers
from turnrl.config.branch import BranchPlan
from turnrl.envs import contract
from turnrl.envs.base import Env
from turnrl.rollout.branch import Forks
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.env_calls import EnvThreads, checked_observation, checked_step
from turnrl.rollout.loop_stats import LoopStats
from turnrl.rollout.seats import Seats
from turnrl.rollout.slots import BRANCH as _BRANCH
from turnrl.rollout.slots import ENV as _ENV
from turnrl.rollout.slots import POLICY as _POLICY
from turnrl.rollout.slots import RESET as _RESET
from turnrl.rollout.slots import (
    Feed,
    Group,  # noqa: F401 - imported from here by the trainers
)
from turnrl.rollout.slots import GroupState as _GroupState
from turnrl.rollout.slots import Slot as _Slot
from turnrl.rollout.turns import TurnRule
from turnrl.samplers.base import Completion, Engine, SamplingParams
from turnrl.types import Episode

BATCH_WINDOW_S = 0.002
"""An idle pool waits this long after one env step ends for the others to join the next
generate call (a decode step costs about the same for 1 row as for 16), so a group played
alone samples what the lock-step loop samples from its seed (common random numbers)."""


class TurnLoop:
    """A pool of episodes over one engine; see the module docstring.

    ``pool_size`` is the target number of live episodes (None: start everything submitted);
    a group is only ever started whole, and always when the pool is empty.
    ``before_generate`` runs before each generate call (in the generation thread; in
    lock-step on the loop's own thread).
    ``lockstep``: generate only when no environment call is in flight, so every live episode
    takes each turn together (the sync trainer's batches; see ``run_episodes``).
    """

    def __init__(
        self,
        make: Callable[[], Env],
        engine: Engine,
        chat: ChatFormat,
        params: SamplingParams,
        *,
        group_size: int,
        pool_size: int | None = None,
        env_name: str = "env",
        max_turns: int = 8,
        max_context: int | None = None,
        env_timeout_s: float = 30.0,
        before_generate: Callable[[], None] | None = None,
        partial_rollouts: bool = True,
        worker: int = -1,
        lockstep: bool = False,
        branch: BranchPlan | None = None,
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.make, self.engine, self.chat, self.params = make, engine, chat, params
        self.group_size, self.pool_size, self.env_name = group_size, pool_size, env_name
        leftovers.ENVS_PLAYED.add(env_name)  # named if it leaves threads or processes behind
        self.turns = TurnRule(chat, params, env_name=env_name, max_turns=max_turns,
                              max_context=max_context)
        """What a reset or step does to its episode (turns.py)."""
        self.seats = Seats(self.turns)
        """The seats of multi-seat games (seats.py)."""
        self.env_timeout_s, self.before_generate = env_timeout_s, before_generate
        self.partial_rollouts, self.worker, self.lockstep = partial_rollouts, worker, lockstep
        self.stats = LoopStats()
        self.env_latencies: deque[float] = deque(maxlen=1024)  # step seconds, newest last
        self.reset_latencies: deque[float] = deque(maxlen=256)  # reset seconds
        self.call_costs: deque[tuple[int, float]] = deque(maxlen=256)  # (rows, s) a call
        self.lock = threading.RLock()
        """Guards the feed, the groups and the finished queue (shared with other threads)."""
        self._ready = threading.Condition(self.lock)
        self._feed = Feed()
        self._groups: dict[int, _GroupState] = {}
        self._finished: deque[Group] = deque()
        self._slots: list[_Slot] = []
        self._ended: list[list[int]] = []
        """Token ids of episodes ended since the last generate call: their cache is released
        in the generation thread (the engine is not safe to touch from this one mid-call)."""
        self._stopping = False
        self._threads = EnvThreads(env_name)
        self.forks = Forks(branch, self._threads, env_name, env_timeout_s, make) if branch else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.error: BaseException | None = None
        """What ended ``run`` with an exception, for callers in other threads."""

    # ---- thread-safe interface -------------------------------------------------------------

    def submit(self, assignment: int, seed: int, *, group: int | None = None,
               episodes: int | None = None, make: Callable[[], Env] | None = None,
               temperature: float | None = None) -> None:
        """Queue one group: ``episodes`` (default ``group_size``) episodes of ``seed``,
        delivered as ``assignment``; ``Episode.group`` is ``group`` (default the assignment);
        ``make``, ``temperature``: its own env and sampling temperature (None: the loop's)."""
        with self.lock:
            if assignment in self._groups or assignment in self._feed:
                return  # already here: a re-sent assignment must not be played twice
            self._feed.push(assignment, seed, assignment if group is None else group,
                            episodes or self.group_size, (make, temperature))
        self._poke()

    def withdraw(self, assignments: Sequence[int]) -> list[int]:
        """Drop those of ``assignments`` still queued (moved to another worker); a group in
        play stays (its first delivery counts). Returns the ones dropped."""
        with self.lock:
            return sorted(self._feed.drop(assignments))

    def take_groups(self, max_groups: int | None = None, wait_s: float = 0.0) -> list[Group]:
        """Finished groups, oldest first; waits up to ``wait_s`` for one if none is ready.

        Never call with ``wait_s > 0`` from the loop's own thread.
        """
        with self._ready:
            if not self._finished and wait_s > 0:
                self._ready.wait_for(lambda: self._finished or self.error or self._stopping,
                                     timeout=wait_s)
            count = len(self._finished) if max_groups is None else min(max_groups,
                                                                       len(self._finished))
            return [self._finished.popleft() for _ in range(count)]

    def known_assignments(self) -> set[int]:
        """Every assignment this loop holds: queued, in play, or finished and not yet taken."""
        with self.lock:
            return (self._feed.assignments() | set(self._groups)
                    | {g.assignment for g in self._finished})

    def stop(self) -> None:
        """Make ``run`` return after the current generate call; live episodes are abandoned."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
        self._poke()

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the loop has closed
            pass

    # ---- the loop ------------------------------------------------------------------------

    async def run(self, *, until_drained: bool = False) -> None:
        """Play submitted groups until ``stop()``, or (``until_drained``) until none is left."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        try:
            while not self._stopping:
                self._wake.clear()  # a submit or stop from now on wakes the waits below
                self._admit()
                await asyncio.sleep(0)  # let env steps that just became ready finish
                self._harvest()
                waiting = [s for s in self._slots if s.phase == _POLICY]
                in_flight = any(s.task is not None for s in self._slots)
                if waiting and not (self.lockstep and in_flight):
                    await self._generate(waiting)
                    continue
                pending = [s.task for s in self._slots if s.task is not None]
                if not pending:
                    with self.lock:
                        idle = not self._feed
                    if idle and until_drained:
                        return
                    if idle:
                        await self.stats.idle(self._wake.wait())
                    continue
                # Nobody waits for the policy: sleep until an env step ends (or new work),
                # then give the steps still running a moment to join the same generate call.
                waker = asyncio.ensure_future(self._wake.wait())
                done, _ = await self.stats.idle(asyncio.wait([*pending, waker],
                                                        return_when=asyncio.FIRST_COMPLETED))
                waker.cancel()
                if not self.lockstep and waker not in done:
                    await self.stats.idle(asyncio.wait(pending, timeout=BATCH_WINDOW_S))
        except BaseException as err:
            self.error = err
            raise
        finally:
            for slot in self._slots:
                if slot.task is not None:
                    slot.task.cancel()
                slot.runner.close()
            self._threads.close()
            with self._ready:
                self._ready.notify_all()
            self._loop = None

    def _admit(self) -> None:
        """Start whole groups from the feed while the pool has room for them."""
        if not self.partial_rollouts and self._slots:
            return  # waves: the next one starts when this one has ended
        with self.lock:
            while self._feed and (not self._slots or self.pool_size is None
                                  or len(self._slots) + self.group_size * self.seats.per_game
                                  <= self.pool_size):
                assignment, seed, group, count, (make, temperature) = self._feed.pop()
                episodes = []
                for _ in range(count):
                    slots = self._start(assignment, seed, group, make)
                    for slot in slots:
                        slot.temperature = temperature
                    self._slots += slots
                    episodes += [slot.episode for slot in slots]
                self._groups[assignment] = _GroupState(seed, episodes, len(episodes),
                                                       time.time())
                self.stats.episodes_started += len(episodes)
        self.stats.max_live = max(self.stats.max_live, len(self._slots))

    def _start(self, assignment: int, seed: int, group: int, make=None) -> list[_Slot]:
        """The slots of one new env (from ``make``, default the loop's), its reset launched:
        one slot, or one per seat of a multi-seat game (sharing the env and its thread)."""
        env = contract.chosen_for_seed((make or self.make)(), seed)  # a mix: seats after its draw
        runner = self._threads.runner(env)
        seats = contract.seats(env)
        if seats:
            slots = self.seats.start(env, seats, runner, assignment=assignment, seed=seed,
                                     group=group)
        else:
            slots = [_Slot(Episode(env=self.env_name, seed=seed, group=group), assignment, env,
                           runner, make=make)]
        slots[0].task = self._env_call(slots[0], "reset", seed)
        return slots

    def _env_call(self, slot: _Slot, method: str, arg) -> asyncio.Future:
        """``env.reset(seed)`` or ``env.step(text)`` on the env's own thread, under the
        timeout, its result checked (``env_calls``)."""
        check = checked_observation if method == "reset" else checked_step
        # The env's own latency, timed out or not (async mode sizes its pool by it).
        latencies = self.env_latencies if method == "step" else self.reset_latencies

        async def call():
            return check(await slot.runner.call(method, arg, self.env_timeout_s, latencies),
                         self.env_name)
        return asyncio.ensure_future(call())

    async def _generate(self, waiting: list[_Slot]) -> None:
        """One batched generate call for every waiting episode (one per sampling temperature
        when groups carry their own); launch their env steps."""
        # Weights may only change when no live episode has policy tokens, without partial
        # rollouts; in waves that is exactly the start of each wave.
        may_swap = self.partial_rollouts or not any(s.episode.num_policy_tokens
                                                    for s in self._slots)
        env_running = any(s.phase == _ENV for s in self._slots)
        parts = by_temperature(waiting, self.params)
        calls = [([s.episode.token_ids for s in slots], params) for slots, params in parts]
        started = time.perf_counter()
        if self.lockstep:
            # Nothing runs beside a lock-step generate call (no env call is in flight), so it
            # runs on the loop's own thread: handing it to a worker thread cost ~0.3 s of a
            # 1.1 s G=4 collection of SmolLM2 on 2 cores (benchmarks/speed/step_throughput.py).
            completions, version = self._generate_batch(calls, may_swap)
        else:
            completions, version = await asyncio.to_thread(self._generate_batch, calls,
                                                           may_swap)
        if self._stopping:
            return  # stopped while generating (maybe before any weights came): drop it
        seconds = time.perf_counter() - started
        self.call_costs.append((len(waiting), seconds))  # drained by another thread
        self.stats.count_call(len(waiting), seconds, len(self._slots), len(self._groups),
                              env_running)
        for (slots, _), done in zip(parts, completions, strict=True):
            for slot, completion in zip(slots, done, strict=True):
                text = self.turns.reply(slot, completion, version)
                slot.task = self._env_call(slot, "step", text)

    def _generate_batch(self, calls: list[tuple[list[list[int]], SamplingParams]],
                        may_swap: bool) -> tuple[list[list[Completion]], int]:
        with self.lock:
            ended, self._ended = self._ended, []
        if ended and hasattr(self.engine, "release"):
            self.engine.release(ended)
        if may_swap and self.before_generate is not None:
            before = self.engine.version
            self.before_generate()
            self.stats.version_swaps += self.engine.version != before
        version = self.engine.version  # tokens carry the version that sampled them
        return [self.engine.generate(prompts, params) for prompts, params in calls], version

    def _harvest(self) -> None:
        """Apply every finished reset and env step; move ended episodes out of the pool (a
        game's step may end its other seats too, so the ends are collected after)."""
        for slot in self._slots:
            if slot.task is not None and slot.task.done():
                task, slot.task = slot.task, None
                error = task.exception() if not task.cancelled() else TimeoutError()
                result = None if error else task.result()
                if slot.game is not None:
                    self.seats.after_call(slot, error, result)
                elif slot.phase == _BRANCH:
                    self.forks.after_replay(slot, error)
                elif slot.phase == _RESET:
                    self.turns.after_reset(slot, error, result)
                else:
                    self.turns.after_step(slot, error, result)
        still = []
        for slot in self._slots:
            if slot.episode.status == "running":
                still.append(slot)
                if self.forks is not None and self.forks.due(slot):  # tree rollouts
                    still += self.forks.fork(slot, self._groups[slot.assignment], self.stats)
            else:
                self._episode_ended(slot)
        self._slots = still

    def _episode_ended(self, slot: _Slot) -> None:
        if slot.game is not None:
            self.seats.ended(slot)
        slot.runner.close()
        self.stats.episodes_finished += 1
        with self._ready:
            self._ended.append(slot.episode.token_ids)
            state = self._groups[slot.assignment]
            state.open -= 1
            if state.open:
                return
            del self._groups[slot.assignment]
            self._finished.append(Group(slot.assignment, state.seed, state.episodes,
                                        self.worker, state.started_at, time.time()))
            self.stats.groups_finished += 1
            self._ready.notify_all()


def by_temperature(waiting: list[_Slot], params: SamplingParams
                   ) -> list[tuple[list[_Slot], SamplingParams]]:
    """``waiting`` split by its groups' sampling temperatures (``Slot.temperature``; None:
    ``params``'), in order of first appearance: one part, in the given order, when every
    group samples at ``params``'."""
    parts: dict[float | None, list[_Slot]] = {}
    for slot in waiting:
        parts.setdefault(slot.temperature, []).append(slot)
    return [(slots, params if t is None else replace(params, temperature=t))
            for t, slots in parts.items()]


def run_sync(coro):
    """``asyncio.run`` for the trainer, except that tasks still pending at the end (an env
    step that timed out and ignores cancellation) are cancelled once and abandoned."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.close()


async def run_episodes(
    make: Callable[[], Env],
    seeds: Sequence[tuple[int, int]],
    engine: Engine,
    chat: ChatFormat,
    params: SamplingParams,
    *,
    env_name: str = "env",
    max_turns: int = 8,
    max_context: int | None = None,
    env_timeout_s: float = 30.0,
    branch: BranchPlan | None = None,
) -> list[Episode]:
    """Play one episode per ``(seed, group)`` pair to the end, all turns of all episodes
    batched (the loop in lock-step); episodes come back in the order of ``seeds``. With
    ``branch`` (tree rollouts) each pair's leaves come back in its place, the first one the
    episode that trains the shared turns."""
    loop = TurnLoop(make, engine, chat, params, group_size=1, env_name=env_name,
                    max_turns=max_turns, max_context=max_context, env_timeout_s=env_timeout_s,
                    lockstep=True, branch=branch)
    for index, (seed, group) in enumerate(seeds):
        loop.submit(index, seed, group=group)
    await loop.run(until_drained=True)
    finished = sorted(loop.take_groups(), key=lambda g: g.assignment)
    return [episode for group in finished for episode in group.episodes]
