"""Calling environment code that may misbehave: each env runs on its own thread and event loop.

An environment's ``reset`` and ``step`` are user code. Written as ``async def`` they can still
block (``time.sleep``, a blocking HTTP call, a CPU-bound loop), and on the turn loop's own
event loop a blocked call freezes every episode and no timeout can fire. So every env gets
an ``EnvRunner``: a daemon thread running an event loop of its own, on which all of that
env's calls run (an env that keeps loop-bound state, a lock or a session, keeps its loop).
The turn loop awaits the call's future with the timeout, so a call that overruns fails its
episode with status "timeout" whatever it does: blocks, spins, swallows cancellation or
never returns. Plain ``def reset/step`` are accepted too (run on that thread).

What cannot be done: Python cannot kill a thread. A call that never returns keeps its
thread (and a core, if it spins) until the process exits; the thread is a daemon, so it
never holds up the end of the run, and the episode was failed and left behind at the
timeout. Environments that must be stopped hard belong in a subprocess (``turnrl.sandbox``
for model-written code).

Envs that declare ``cooperative = True`` (they never block) share one thread and loop per
turn loop instead (``SharedLoop``): fewer wake-ups, at the price that one that blocks anyway
stalls the others until their timeouts; the turn loop then stops sharing.

Validation: ``reset`` must return a ``str``; ``step`` a ``StepResult`` with a ``str``
observation, a finite number as reward (a NaN or infinite reward fails the episode here;
finite rewards whose sum is not finite within ``types.REWARD_LIMIT`` fail it where they enter
it, ``Episode.add_turn``: neither reaches the advantages), a ``bool`` done and a ``dict`` (or ``None``) info. Anything
else fails the episode with a one-line reason naming the environment and the field. So does
any exception an env call raises on the env's thread, ``KeyboardInterrupt``, ``SystemExit``
and ``GeneratorExit`` included (``_as_exception``: asyncio would re-raise those out of the
turn loop); env code read on the turn loop's own thread (``seat_to_move``, ``observe``,
``system_prompt``, ``state_key``) is caught for ``safe_json.USER_ERRORS``, every exception
but a ``KeyboardInterrupt``, which there cannot be told from Ctrl-C and stops the run. An
``info["success"]`` that cannot be read as a bool, or ``tool_results`` that are not a list
of dicts, fail it too. What ``info`` holds enters the episode JSON-safe and bounded
(``safe_json.json_safe``: an env's sets, tensors or custom objects never crash the write of
the episode file).
``end_turn`` records a policy turn with the env's answer (or failure) on the episode; every
ended episode carries its ``end_reason`` (``turnrl.types.END_REASONS``).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from turnrl import leftovers
from turnrl.envs.base import StepResult
from turnrl.envs.contract import is_cooperative, start_state, step_state
from turnrl.safe_json import USER_ERRORS, json_safe, safe_repr, safe_text
from turnrl.types import Episode, Turn, finite_real


class EnvError(Exception):
    """What an env returned or raised, as a one-line reason for the episode's ``info``."""


def cooperative(env: Any) -> bool:
    """Whether ``env`` declares (class attribute ``cooperative = True``) that its reset and
    step never block their event loop: they await all waiting and do little work between."""
    return is_cooperative(env)


class SharedLoop:
    """One thread and event loop that the envs of one turn loop that declare themselves
    ``cooperative`` share, instead of a thread each.

    Why: a thread per env is woken once per call (twice with a tool's latency) and takes the
    GIL from the generating thread each time; one shared thread takes many calls per wake.
    Tiny model, worker loop alone, rows a second (``benchmarks/speed/env_threads.py``, median of 6,
    idle 2-core AMD EPYC): 242 vs 228 at 0 ms, 210 vs 189 at 500 ms.

    The price: an env that blocks anyway (a ``time.sleep`` in ``async def step``) stalls the
    others on this loop; their calls still time out on the caller's side, so the turn loop
    never stalls. ``stalled`` tells when a callback here blocked the loop for over
    ``STALL_S``: the owner then stops sharing (every later env gets its own thread) and says
    which env it was.

    Blocked, not starved: the loop's heartbeat (every ``BEAT_S``) is late both when a callback
    blocks it and when the whole process is not run (a busy machine: other processes on the
    cores, the process stopped, another thread holding the GIL in one long C call, such as
    unpickling weights). Only the first is the env's fault, so a control thread (``_watch``,
    waking every ``BEAT_S`` too, and doing nothing else) records the windows in which it was
    late itself: what starved the process starved it too, while a blocking callback does not
    delay it (``time.sleep`` and I/O release the GIL, and pure-Python work hands it over every
    5 ms). A heartbeat gap is blocking when what remains of it outside those windows is over
    ``STALL_S``, or when the loop thread itself spent over ``STALL_S`` of CPU in it (a
    CPU-bound C call that holds the GIL delays the control thread too, but its CPU time is
    its own; a starved thread uses none). Chosen over timing each env callback: nothing is
    added to the calls (the shared loop exists for their cost), and it also sees a blocking
    task an env started itself. Not seen: a call that holds the GIL while waiting (a C
    extension's blocking I/O without releasing it) looks like starvation."""

    STALL_S = 1.0
    """A callback that keeps the loop for this long, not counting starvation, is blocking."""
    BEAT_S = STALL_S / 4
    """The heartbeat's and the control thread's period: a healthy loop beats on time but for
    the GIL's switch interval (5 ms)."""
    LATE_WINDOWS = 64
    """Late windows of the control thread kept (16 s of beats, each late)."""

    def __init__(self, name: str = "env") -> None:
        self.loop = asyncio.new_event_loop()
        self.beat, self.beat_cpu, self.has_stalled = time.monotonic(), 0.0, False
        self.control_due = self.beat + self.BEAT_S
        self.late: deque[tuple[float, float]] = deque(maxlen=self.LATE_WINDOWS)
        """(due, woke) of each beat the control thread was late for: starvation."""
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._serve, name=f"env-{name}-shared",
                                       daemon=True)
        self.control = threading.Thread(target=self._watch, name=f"env-{name}-control",
                                        daemon=True)
        self.thread.start()
        self.control.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.beat_cpu = time.thread_time()
        self.loop.call_soon(self._heartbeat)
        self.loop.run_forever()

    def _heartbeat(self) -> None:
        now, cpu = time.monotonic(), time.thread_time()
        blocked = blocked_seconds(self.beat, now, self._starved_windows(now), cpu - self.beat_cpu)
        self.has_stalled |= blocked > self.STALL_S
        self.beat, self.beat_cpu = now, cpu
        self.loop.call_later(self.BEAT_S, self._heartbeat)

    def _watch(self) -> None:
        """The control thread: wakes every ``BEAT_S``, notes when it woke late."""
        while not self.closing.wait(max(0.0, self.control_due - time.monotonic())):
            woke = time.monotonic()
            if woke > self.control_due:
                self.late.append((self.control_due, woke))
            self.control_due = woke + self.BEAT_S

    def _starved_windows(self, now: float) -> tuple[tuple[float, float], ...]:
        """The control thread's late windows, with the one it is late for now, if any."""
        due = self.control_due  # read before the windows: the thread appends, then moves it
        late = tuple(self.late)
        if now <= due or (late and late[-1][0] >= due):  # on time, or just recorded
            return late
        return (*late, (due, now))

    @property
    def stalled(self) -> bool:
        """Blocked for over ``STALL_S``, now or at any time before (``blocked_seconds``)."""
        if self.has_stalled:
            return True
        now = time.monotonic()
        # A callback running now: its CPU time is not readable from here, the wall time is.
        return blocked_seconds(self.beat, now, self._starved_windows(now), 0.0) > self.STALL_S

    def close(self) -> None:
        """Cancel what still runs, stop the loop and the control thread (never waits)."""
        self.closing.set()
        _stop(self.loop)


def blocked_seconds(start: float, end: float, starved: Any, cpu_s: float) -> float:
    """How long a loop that ran no callback from ``start`` to ``end`` was blocked: the wall
    time outside the ``starved`` windows ((from, to) pairs, when the process was not run), or
    the loop thread's own CPU time ``cpu_s`` in it, whichever is more."""
    overlap = sum(max(0.0, min(end, to) - max(start, begin)) for begin, to in starved)
    return max(end - start - overlap, cpu_s)


class EnvThreads:
    """Where a turn loop's envs run: each on its own thread, or a ``cooperative`` one on the
    loop they share, until an env has once blocked that loop for over ``SharedLoop.STALL_S``
    (a process that was merely not run for that long, on a busy machine, does not count):
    then every later env gets its own thread (the calls stuck behind the block time out as
    usual), with a warning."""

    def __init__(self, env_name: str) -> None:
        self.env_name = env_name
        self.shared: SharedLoop | None | bool = None  # made on first use; False once blocked
        self.blocked: SharedLoop | None = None  # the given-up loop, serving the envs it had

    def runner(self, env: Any) -> EnvRunner:
        if not cooperative(env) or self.shared is False:
            return EnvRunner(env, self.env_name)
        if self.shared is not None and self.shared.stalled:
            warnings.warn(f"env {self.env_name!r} declares cooperative = True but blocked its "
                          f"shared event loop for over {SharedLoop.STALL_S:.0f} s: each env gets "
                          "its own thread from now on (remove cooperative, or await the "
                          "blocking work with asyncio.to_thread)", stacklevel=2)
            self.blocked, self.shared = self.shared, False  # its calls finish there, or time out
            return EnvRunner(env, self.env_name)
        if self.shared is None:
            self.shared = SharedLoop(self.env_name)
        return EnvRunner(env, self.env_name, shared=self.shared)

    def close(self) -> None:
        """Stop the shared loop (a later run makes a new one, unless sharing was given up)."""
        if self.blocked is not None:
            self.blocked.close()
            self.blocked = None
        if self.shared:
            self.shared.close()
            self.shared = None


class EnvRunner:
    """One env's thread and event loop, or (``shared``) its place on a ``SharedLoop``;
    ``call`` runs a method there, under a timeout."""

    def __init__(self, env: Any, name: str = "env", shared: SharedLoop | None = None) -> None:
        self.env, self.name, self.shared = env, name, shared
        if shared is not None:
            self.loop = shared.loop
            return
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name=f"env-{name}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def call(self, method: str, arg: Any, timeout_s: float,
                   seconds: Any = None) -> Any:
        """``env.<method>(arg)`` on the env's thread; ``TimeoutError`` after ``timeout_s``
        (the call is cancelled if it ever yields, and abandoned either way).

        ``seconds`` gets the time the env itself took, timed on its thread (the timeout when
        it overran): not the wait for this loop to notice, which grows with the pool and
        would make a pool sized by it grow further.

        One handle each way between the two loops, and a timer here: no thread-safe future
        and no ``wait_for`` task per call (324 vs 206 us of CPU a call, 64 envs answering at
        once), a cost paid on every turn of every episode, with the GIL of the process that
        generates."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        started: list[asyncio.Task] = []  # the env-side task, once the env's loop made it
        timed_out = TimeoutError(f"env {self.name} {method} took over {timeout_s} s")

        def deliver(result: Any, error: BaseException | None) -> None:  # on this loop
            if not answer.done():
                answer.set_result(result) if error is None else answer.set_exception(error)

        async def run() -> None:  # on the env's loop
            try:
                with leftovers.busy(f"env {self.name!r} {method}"):  # exit waits for it
                    outcome = await _timed(_invoke(getattr(self.env, method), arg), seconds), None
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    return  # timed out, or the caller went away: nobody waits for an answer
                # Raised inside the env (a task of its own cancelled): its answer, not a hang
                # until the timeout.
                outcome = None, EnvError(f"env {self.name} {method} raised CancelledError "
                                         "from inside (not a timeout)")
            except BaseException as err:  # noqa: BLE001 - the caller gets it, as raised
                outcome = None, _as_exception(err, f"env '{self.name}' {method}")
            try:
                loop.call_soon_threadsafe(deliver, *outcome)
            except RuntimeError:  # the caller's loop has closed
                pass

        self.loop.call_soon_threadsafe(lambda: started.append(self.loop.create_task(run())))
        timer = loop.call_later(timeout_s, deliver, None, timed_out)
        try:
            return await answer
        except BaseException as err:
            if err is timed_out and seconds is not None:
                seconds.append(timeout_s)
            if err is timed_out or isinstance(err, asyncio.CancelledError):
                self._cancel(started)
            raise
        finally:
            timer.cancel()

    def _cancel(self, started: list[asyncio.Task]) -> None:
        """Cancel a call's task on the env's loop (queued after its start, so it is there)."""
        try:
            self.loop.call_soon_threadsafe(lambda: started and started[0].cancel())
        except RuntimeError:  # the env's loop has closed
            pass

    def close(self) -> None:
        """Cancel what still runs there and stop the loop; never waits for it (a call that
        ignores cancellation keeps the thread until it returns, if ever). On a shared loop,
        nothing: a call that timed out or lost its caller was cancelled then, and what an env
        left running there is cancelled when the turn loop stops the shared loop."""
        if self.shared is None:
            _stop(self.loop)


def _as_exception(error: BaseException, where: str) -> BaseException:
    """``error``, an env call raised on the env's own thread, as its caller may get it: an
    ``Exception`` as raised; a ``KeyboardInterrupt``, ``SystemExit`` or ``GeneratorExit`` (env
    code's own: Ctrl-C reaches the main thread, never this one) as an ``EnvError`` naming it,
    since asyncio re-raises those out of the turn loop instead of failing one episode."""
    if isinstance(error, Exception):
        return error
    return EnvError(f"{where} raised {raised(error)}")


def raised(error: BaseException) -> str:
    """``error`` as one bounded line: its type, then its message when it has one."""
    message = safe_text(error).replace("\n", " ")
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _stop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task on ``loop`` and stop it, from any thread; never waits."""
    if not loop.is_running():
        return
    try:
        loop.call_soon_threadsafe(_shut_down, loop)
    except RuntimeError:  # closed meanwhile
        pass


def _shut_down(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.call_soon(loop.stop)  # after the cancellations are delivered


async def _timed(call: Any, seconds: Any) -> Any:
    """Await ``call``, appending its seconds to ``seconds``; a cancelled call (timed out) is
    left to the caller, which counts it as the timeout."""
    started = time.perf_counter()
    try:
        result = await call
    except asyncio.CancelledError:
        raise
    except BaseException:
        if seconds is not None:
            seconds.append(time.perf_counter() - started)
        raise
    if seconds is not None:
        seconds.append(time.perf_counter() - started)
    return result


async def _invoke(method: Callable[[Any], Any], arg: Any) -> Any:
    result = method(arg)
    return await result if inspect.isawaitable(result) else result


def checked_observation(value: Any, env: str) -> str:
    """``value`` if it is a ``str``; else ``EnvError``."""
    if not isinstance(value, str):
        raise EnvError(f"env '{env}' reset returned {type(value).__name__}, not str; return the "
                       "first observation as text")
    return value


def checked_step(value: Any, env: str) -> StepResult:
    """``value`` if it is a well-formed ``StepResult``; else ``EnvError`` naming the field."""
    if not isinstance(value, StepResult):
        raise EnvError(f"env '{env}' step returned {type(value).__name__}; return "
                       "StepResult(observation, reward, done, info)")
    observation, reward, done, info = value
    if not isinstance(observation, str):
        raise EnvError(f"env '{env}' step returned observation of type "
                       f"{type(observation).__name__}; return a str")
    if not finite_real(reward):
        raise EnvError(f"env '{env}' step returned reward {safe_repr(reward)}; return a finite "
                       "number")
    if not isinstance(done, bool | np.bool_):
        raise EnvError(f"env '{env}' step returned done of type {type(done).__name__}; "
                       "return a bool")
    if info is not None and not isinstance(info, dict):
        raise EnvError(f"env '{env}' step returned info of type {type(info).__name__}; "
                       "return a dict or None")
    if info and "success" in info:
        try:
            bool(info["success"])
        except USER_ERRORS as err:  # e.g. a numpy array of several values
            raise EnvError(f"env '{env}' step returned info['success'] that is not a bool "
                           f"({type(info['success']).__name__}: bool() raised "
                           f"{type(err).__name__}); return True or False") from None
    results = (info or {}).get("tool_results")
    if results is not None and not (isinstance(results, list)
                                    and all(isinstance(r, dict) for r in results)):
        raise EnvError(f"env '{env}' step returned info['tool_results'] of type "
                       f"{type(results).__name__}; return a list of dicts "
                       "({'name', 'content'} or {'name', 'error'} per call)")
    return value


def fail_episode(episode: Episode, error: BaseException, where: str) -> None:
    """End ``episode`` for an env call that timed out, raised or returned a malformed value.
    The reason is bounded text: an exception whose message is huge, or whose ``__str__``
    raises, cannot make the episode unwritable."""
    if isinstance(error, TimeoutError):
        episode.end("timeout", "env_timeout", f"env {where} timed out")
    elif isinstance(error, EnvError):  # a malformed return: the message names the field
        episode.end("error", "env_error", safe_text(error))
    else:
        episode.end("error", "env_error", f"env {where} raised {raised(error)}")


def env_prompt(chat: Any, env: Any, first: str, name: str
               ) -> tuple[str | None, list[dict] | None, str]:
    """(system prompt, tool schemas, start state key) of a freshly reset env: attributes
    that env code computes (a property, ``tool_prompt``) and may make raise, or make the
    wrong type; ``EnvError`` then, with a one-line reason. The env's own ``state_key``, when
    it has one, names the start state, so a later return to it matches."""
    try:
        system_prompt, tools = chat.env_prompt(env)
        state = state_text(start_state(env, first))
    except USER_ERRORS as err:  # user code: its failure fails the episode
        raise EnvError(f"env '{name}' system_prompt, tool_prompt or state_key raised "
                       f"{type(err).__name__}: {safe_text(err)}") from None
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise EnvError(f"env '{name}' system_prompt is {type(system_prompt).__name__}; make "
                       "it a str or None")
    return system_prompt, tools, state


MAX_STATE_CHARS = 1_000
"""A longer state key is kept as its start and a digest of the whole: every turn stores its
state, and keys are only compared for equality (GiGPO's groups), which the digest keeps."""


def state_text(value: Any) -> str:
    """A state key as text (``str``, which env code may make raise: then its type), bounded
    (``MAX_STATE_CHARS``)."""
    try:
        text = value if isinstance(value, str) else str(value)
    except USER_ERRORS:  # user objects may raise anything here
        return f"<{type(value).__name__}>"
    if len(text) <= MAX_STATE_CHARS:
        return text
    digest = hashlib.blake2b(text.encode(errors="surrogatepass"), digest_size=16).hexdigest()
    return f"{text[:200]}...[{len(text)} chars, blake2b {digest}]"


def end_turn(episode: Episode, outcome: StepResult | BaseException, start: int, end: int,
             text: str, finish_reason: str, state: str, max_turns: int,
             observation: str | None = None) -> str | None:
    """Record a policy turn and the env's answer (or failure): the next state key, or None
    when the episode has ended (done, failed, or out of turns). ``observation``: what to
    store instead of the env's observation (``record_turn``)."""
    if isinstance(outcome, BaseException):
        episode.turns.append(Turn(start, end, text, "", 0.0, finish_reason, state))
        fail_episode(episode, outcome, "step")
        return None
    if not record_turn(episode, outcome, start, end, text, finish_reason, state, observation):
        return None  # its reward failed the episode (Episode.add_turn)
    if outcome.done:
        episode.end("done", "done")
        return None
    if len(episode.turns) >= max_turns:
        episode.end("truncated", "turn_limit", f"turn limit ({max_turns} turns)")
        return None
    return state_text(step_state(outcome.info or {}, outcome.observation))


def record_turn(episode: Episode, result: StepResult, start: int, end: int, text: str,
                finish_reason: str, state: str, observation: str | None = None) -> bool:
    """Add the turn, its reward and the env's ``info`` (made JSON-safe and bounded here, where
    it enters the episode) to ``episode``. ``observation``: what to store as the turn's
    observation instead of the env's (a preview of one too large to keep). False when the
    reward failed the episode: it, or the return it makes, is not finite (``add_turn``)."""
    added = episode.add_turn(Turn(start, end, text,
                                  result.observation if observation is None else observation,
                                  float(result.reward), finish_reason, state))
    info = dict(result.info or {})
    info.pop("state_key", None)
    if "success" in info:
        episode.success = bool(info.pop("success"))  # checked_step: bool() does not raise
    episode.info.update(json_safe(info))
    return added
