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
Multi-seat games (self-play): one env, one episode per seat (rollout/seats.py).
Plain asyncio: a Ray ``RolloutWorker`` runs it in a thread; ``submit``,
``take_groups``, ``known_assignments`` and ``stop`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from turnrl import leftovers
from turnrl.envs import contract
from turnrl.envs.base import Env
from turnrl.rollout.chat import ChatFormat
from turnrl.rollout.env_calls import (
    EnvError,
    EnvThreads,
    checked_observation,
    checked_step,
    end_turn,
    env_prompt,
    fail_episode,
)
from turnrl.rollout.input_bounds import InputBound
from turnrl.rollout.loop_stats import LoopStats
from turnrl.rollout.seats import SeatedGames
from turnrl.rollout.slots import ENV as _ENV
from turnrl.rollout.slots import POLICY as _POLICY
from turnrl.rollout.slots import RESET as _RESET
from turnrl.rollout.slots import Game as _Game
from turnrl.rollout.slots import Group  # noqa: F401 - imported from here by the trainers
from turnrl.rollout.slots import GroupState as _GroupState
from turnrl.rollout.slots import Slot as _Slot
from turnrl.samplers.base import Completion, Engine, SamplingParams
from turnrl.types import Episode

BATCH_WINDOW_S = 0.002
"""An idle pool waits this long after one env step ends for the others to join the next
generate call (a decode step costs about the same for 1 row as for 16), so a group played
alone samples what the lock-step loop samples from its seed (common random numbers)."""


class TurnLoop(SeatedGames):
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
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.make, self.engine, self.chat, self.params = make, engine, chat, params
        self.group_size = group_size
        self.pool_size = pool_size
        self.env_name = env_name
        leftovers.ENVS_PLAYED.add(env_name)  # named if it leaves threads or processes behind
        self.max_turns = max_turns
        self.max_context = max_context
        self.bound = InputBound(chat, max_context, getattr(params, "max_new_tokens", 0))
        self.env_timeout_s = env_timeout_s
        self.before_generate = before_generate
        self.partial_rollouts = partial_rollouts
        self.worker = worker
        self.lockstep = lockstep
        self.stats = LoopStats()
        self._game_numbers = itertools.count()  # a multi-seat game's ``game_id``
        self.env_latencies: deque[float] = deque(maxlen=1024)  # step seconds, newest last
        self.reset_latencies: deque[float] = deque(maxlen=256)  # reset seconds
        self.call_costs: deque[tuple[int, float]] = deque(maxlen=256)  # (rows, s) a call
        self.lock = threading.RLock()
        """Guards the feed, the groups and the finished queue (shared with other threads)."""
        self._ready = threading.Condition(self.lock)
        self._feed: deque[tuple[int, int, int, int]] = deque()
        """(assignment, seed, group label, episodes) waiting to start."""
        self._queued: set[int] = set()
        """The feed's assignments: a scan of the feed on each submit made a long feed (an
        evaluation's episodes, submitted at once) quadratic."""
        self._groups: dict[int, _GroupState] = {}
        self._finished: deque[Group] = deque()
        self._slots: list[_Slot] = []
        self._ended: list[list[int]] = []
        """Token ids of episodes ended since the last generate call: their cache is released
        in the generation thread (the engine is not safe to touch from this one mid-call)."""
        self._stopping = False
        self._idle_since: float | None = None
        self._threads = EnvThreads(env_name)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.error: BaseException | None = None
        """What ended ``run`` with an exception, for callers in other threads."""

    # ---- thread-safe interface -------------------------------------------------------------

    def submit(self, assignment: int, seed: int, *, group: int | None = None,
               episodes: int | None = None) -> None:
        """Queue one group: ``episodes`` (default ``group_size``) episodes of ``seed``,
        delivered as ``assignment``; ``Episode.group`` is ``group`` (default the assignment)."""
        with self.lock:
            if assignment in self._groups or assignment in self._queued:
                return  # already here: a re-sent assignment must not be played twice
            self._feed.append((assignment, seed, assignment if group is None else group,
                               episodes or self.group_size))
            self._queued.add(assignment)
        self._poke()

    def withdraw(self, assignments: Sequence[int]) -> list[int]:
        """Drop those of ``assignments`` still queued (moved to another worker); a group in
        play stays (its first delivery counts). Returns the ones dropped."""
        with self.lock:
            dropped = self._queued.intersection(assignments)
            if dropped:
                self._feed = deque(item for item in self._feed if item[0] not in dropped)
                self._queued -= dropped
        return sorted(dropped)

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
            return (set(self._queued) | set(self._groups)
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
                        await self._idle(self._wake.wait())
                    continue
                # Nobody waits for the policy: sleep until an env step ends (or new work),
                # then give the steps still running a moment to join the same generate call.
                waker = asyncio.ensure_future(self._wake.wait())
                done, _ = await self._idle(asyncio.wait([*pending, waker],
                                                        return_when=asyncio.FIRST_COMPLETED))
                waker.cancel()
                if not self.lockstep and waker not in done:
                    await self._idle(asyncio.wait(pending, timeout=BATCH_WINDOW_S))
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

    async def _idle(self, wait):
        """Await ``wait``, counting the time as idle (``LoopStats.idle_s``)."""
        self._idle_since = time.perf_counter()
        try:
            return await wait
        finally:
            since, self._idle_since = self._idle_since, None  # a reader never counts it twice
            self.stats.idle_s += time.perf_counter() - since

    def report(self) -> dict[str, float]:
        """The counters now (any thread): ``idle_s`` includes a wait in progress, and
        ``clock_s`` is when they were read, on this process's clock, so that busy = 1 -
        idle / wall between two reports needs no other clock."""
        stats = self.stats.to_dict()
        since = self._idle_since  # read second: a wait that just ended is never counted twice
        if since is not None:
            stats["idle_s"] += max(0.0, time.perf_counter() - since)
        stats["clock_s"] = time.perf_counter()
        return stats

    def _admit(self) -> None:
        """Start whole groups from the feed while the pool has room for them."""
        if not self.partial_rollouts and self._slots:
            return  # waves: the next one starts when this one has ended
        with self.lock:
            while self._feed and (not self._slots or self.pool_size is None
                                  or len(self._slots) + self.group_size * self.seats_per_game
                                  <= self.pool_size):
                assignment, seed, group, count = self._feed.popleft()
                self._queued.discard(assignment)
                episodes = []
                for _ in range(count):
                    slots = self._start(assignment, seed, group)
                    self._slots += slots
                    episodes += [slot.episode for slot in slots]
                self._groups[assignment] = _GroupState(seed, episodes, len(episodes),
                                                       time.time())
                self.stats.episodes_started += len(episodes)
        self.stats.max_live = max(self.stats.max_live, len(self._slots))

    def _start(self, assignment: int, seed: int, group: int) -> list[_Slot]:
        """The slots of one new env, its reset launched: one slot, or one per seat of a
        multi-seat game (sharing the env and its thread; the reset runs on the first)."""
        env = contract.chosen_for_seed(self.make(), seed)  # a mix: seats after its draw
        runner = self._threads.runner(env)
        seats = contract.seats(env)
        if not seats:
            slot = _Slot(Episode(env=self.env_name, seed=seed, group=group), assignment, env,
                         runner)
            slot.task = self._env_call(slot, "reset", seed)
            return [slot]
        game = _Game(env, number=next(self._game_numbers))
        for seat in seats:
            episode = Episode(env=self.env_name, seed=seed, group=group,
                              info={"role": seat, "opponent": "self", "game_id": game.number})
            game.seats[seat] = _Slot(episode, assignment, env, runner, game=game, seat=seat)
        first = game.seats[seats[0]]
        first.task = self._env_call(first, "reset", seed)
        self.seats_per_game = len(seats)  # a group's slots, for the pool's room (_admit)
        return list(game.seats.values())

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
        """One batched generate call for every waiting episode; launch their env steps."""
        # Weights may only change when no live episode has policy tokens, without partial
        # rollouts; in waves that is exactly the start of each wave.
        may_swap = self.partial_rollouts or not any(s.episode.num_policy_tokens
                                                    for s in self._slots)
        env_running = any(s.phase == _ENV for s in self._slots)
        prompts = [s.episode.token_ids for s in waiting]
        started = time.perf_counter()
        if self.lockstep:
            # Nothing runs beside a lock-step generate call (no env call is in flight), so it
            # runs on the loop's own thread: handing it to a worker thread cost ~0.3 s of a
            # 1.1 s G=4 collection of SmolLM2 on 2 cores (benchmarks/step_throughput.py).
            completions, version = self._generate_batch(prompts, may_swap)
        else:
            completions, version = await asyncio.to_thread(self._generate_batch, prompts,
                                                           may_swap)
        if self._stopping:
            return  # stopped while generating (maybe before any weights came): drop it
        self.stats.generate_s += (seconds := time.perf_counter() - started)
        self.call_costs.append((len(waiting), seconds))  # drained by another thread
        self.stats.generate_calls += 1
        self.stats.generated_rows += len(waiting)
        self.stats.live_at_calls += len(self._slots)
        self.stats.open_groups_at_calls += len(self._groups)
        self.stats.overlapped_calls += env_running
        for slot, completion in zip(waiting, completions, strict=True):
            text = self.chat.tokenizer.decode(completion.token_ids[:-1]
                                              if completion.finish_reason == "stop"
                                              else completion.token_ids)
            start, end = slot.episode.append(completion.token_ids, policy=True,
                                             logprobs=completion.logprobs, version=version)
            slot.turn = (completion, text, start, end)
            slot.phase = _ENV
            slot.task = self._env_call(slot, "step", text)

    def _generate_batch(self, prompts: list[list[int]], may_swap: bool
                        ) -> tuple[list[Completion], int]:
        with self.lock:
            ended, self._ended = self._ended, []
        if ended and hasattr(self.engine, "release"):
            self.engine.release(ended)
        if may_swap and self.before_generate is not None:
            before = self.engine.version
            self.before_generate()
            self.stats.version_swaps += self.engine.version != before
        version = self.engine.version  # tokens carry the version that sampled them
        return self.engine.generate(prompts, self.params), version

    def _harvest(self) -> None:
        """Apply every finished reset and env step; move ended episodes out of the pool (a
        game's step may end its other seats too, so the ends are collected after)."""
        for slot in self._slots:
            if slot.task is not None and slot.task.done():
                task, slot.task = slot.task, None
                error = task.exception() if not task.cancelled() else TimeoutError()
                result = None if error else task.result()
                if slot.game is not None:
                    self._after_game_call(slot, error, result)
                elif slot.phase == _RESET:
                    self._after_reset(slot, error, result)
                else:
                    self._after_step(slot, error, result)
        still = []
        for slot in self._slots:
            if slot.episode.status == "running":
                still.append(slot)
            else:
                self._episode_ended(slot)
        self._slots = still

    def _after_reset(self, slot: _Slot, error: BaseException | None, first: str | None) -> None:
        if error is not None:
            fail_episode(slot.episode, error, "reset")
            return
        try:
            system_prompt, slot.tools, state = env_prompt(self.chat, slot.env, first, self.env_name)
        except EnvError as err:
            return fail_episode(slot.episode, err, "reset")
        if reason := self.bound.start_refused(first, system_prompt):
            return slot.episode.end("truncated", "input_too_large", reason)
        slot.messages, slot.rendered, ids = self.chat.start(first, system_prompt, slot.tools)
        if self._overflows(slot.episode, ids):
            return
        slot.episode.append(ids, policy=False)
        slot.state, slot.phase = state, _POLICY

    def _after_step(self, slot: _Slot, error: BaseException | None, result) -> None:
        """Record the turn; end the episode, or render the env's reply for the next turn."""
        completion, text, start, end = slot.turn
        slot.turn = None
        episode = slot.episode
        reason, kept = self.bound.step_refused(episode, error, result, slot.tools)
        next_state = end_turn(episode, error if error is not None else result, start, end,
                              text, completion.finish_reason, slot.state, self.max_turns,
                              observation=kept)
        if next_state is not None and reason is not None:  # going on, but the reply can't fit
            episode.end("truncated", "input_too_large", reason)
        if episode.status != "running":
            return
        slot.state = next_state
        slot.rendered, ids = self.chat.continue_after(
            slot.messages, slot.rendered, text, completion.finish_reason == "stop",
            result.observation, (result.info or {}).get("tool_results"), slot.tools)
        if self._overflows(episode, ids):
            return
        episode.append(ids, policy=False)
        slot.phase = _POLICY

    def _overflows(self, episode: Episode, ids: list[int]) -> bool:
        """End ``episode`` as truncated if ``ids`` and a whole next reply would not fit the
        model's context; the ids are then left out, so an episode never outgrows it."""
        if not self.max_context or (len(episode.token_ids) + len(ids)
                                    + self.params.max_new_tokens <= self.max_context):
            return False
        episode.end("truncated", "context_length", "context length")
        return True

    def _episode_ended(self, slot: _Slot) -> None:
        if slot.game is not None and self.record_seat_versions:
            self._record_seat_versions(slot)
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
) -> list[Episode]:
    """Play one episode per ``(seed, group)`` pair to the end, all turns of all episodes
    batched (the loop in lock-step); episodes come back in the order of ``seeds``."""
    loop = TurnLoop(make, engine, chat, params, group_size=1, env_name=env_name,
                    max_turns=max_turns, max_context=max_context, env_timeout_s=env_timeout_s,
                    lockstep=True)
    for index, (seed, group) in enumerate(seeds):
        loop.submit(index, seed, group=group)
    await loop.run(until_drained=True)
    finished = sorted(loop.take_groups(), key=lambda g: g.assignment)
    return [episode for group in finished for episode in group.episodes]
