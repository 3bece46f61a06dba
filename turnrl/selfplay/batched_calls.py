"""Calls from many threads answered in batches: one ``run(items)`` for the calls that wait
together, each caller getting its own answer.

Frozen opponents use it (opponents.py ``FrozenPolicy``): a step plays its games on env
threads of their own, and each game's opponent move used to be generated alone, one after
another under a lock. Now the moves asked for while a batch is being generated wait and go
together in the next one, and a first move waits briefly (``window_s`` after the last
arrival) for the others of its burst.

No thread of its own: the first caller to find no batch running leads the next one, running
it on its own thread, and returns with its answer; the callers still waiting then elect the
next leader. So there is nothing to start, stop or leak, and a caller whose game was given
up (an env call that timed out keeps its thread until it returns) still finishes the batch
it leads: the others get their answers. A batch that raises fails each of its calls with
``BatchError`` naming the batch and the cause; the next batch is run as usual.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

WINDOW_S = 0.002
"""How long a batch's leader waits for another call after the last one arrived: a turn
loop's env threads ask within about 1 ms of each other (32 TicTacToe games, tiny model,
busy 2-core machine), and a lone call pays it (`benchmarks/speed/opponent_batching.py`)."""
MAX_BATCH = 64
"""Calls in one batch at most (the rest wait for the next)."""
SIZES_KEPT = 1024


class BatchError(RuntimeError):
    """The batch a call was in failed: every call of that batch gets this, with the cause."""


class _Call:
    __slots__ = ("item", "answer", "error", "done")

    def __init__(self, item: Any) -> None:
        self.item, self.answer, self.error, self.done = item, None, None, False

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.answer


class BatchedCalls:
    """``call(item)`` from any thread returns ``run(items)[i]`` for its item, ``items`` being
    the calls that waited together (in their order of arrival, the leader's first)."""

    def __init__(self, run: Callable[[list[Any]], Sequence[Any]], *, name: str = "batch",
                 window_s: float = WINDOW_S, max_batch: int = MAX_BATCH) -> None:
        if max_batch < 1 or window_s < 0:
            raise ValueError(f"batched calls need max_batch >= 1 and window_s >= 0, got "
                             f"{max_batch} and {window_s}")
        self.run, self.name = run, name
        self.window_s, self.max_batch = window_s, max_batch
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # the leader waits on it
        self._finished = threading.Condition(self._lock)  # the others wait on it
        self._waiting: list[_Call] = []
        self._running = False
        self.batch_sizes: deque[int] = deque(maxlen=SIZES_KEPT)
        """The sizes of the last ``SIZES_KEPT`` batches, in order (tests, benchmarks)."""

    def call(self, item: Any) -> Any:
        """The answer to ``item``, run in a batch with the calls waiting at the same time."""
        mine = _Call(item)
        with self._lock:
            self._waiting.append(mine)
            self._arrived.notify()
            while self._running and not mine.done:
                self._finished.wait()
            if mine.done:
                return mine.outcome()
            self._running = True  # this thread leads the next batch
        try:
            self._run(self._gather(mine))
        finally:
            with self._lock:
                self._running = False
                self._finished.notify_all()
        return mine.outcome()

    def _gather(self, leader: _Call) -> list[_Call]:
        """The leader's call and the others waiting, once none has arrived for ``window_s``
        (or the batch is full), taken off the queue."""
        with self._lock:
            seen = len(self._waiting)
            while seen < self.max_batch and self.window_s > 0:
                self._arrived.wait(self.window_s)
                if len(self._waiting) == seen:
                    break
                seen = len(self._waiting)
            others = [c for c in self._waiting if c is not leader][:self.max_batch - 1]
            batch = [leader, *others]
            taken = {id(c) for c in batch}
            self._waiting = [c for c in self._waiting if id(c) not in taken]
            self.batch_sizes.append(len(batch))
        return batch

    def _run(self, batch: list[_Call]) -> None:
        """Answer every call of ``batch``, or fail every one with the reason."""
        try:
            answers = list(self.run([c.item for c in batch]))
            if len(answers) != len(batch):
                raise RuntimeError(f"{len(answers)} answers for {len(batch)} calls")
        except BaseException as err:  # noqa: BLE001 - each caller gets it; re-raised below
            failure = BatchError(f"{self.name}: a batch of {len(batch)} failed: "
                                 f"{type(err).__name__}: {err}")
            failure.__cause__ = err
            with self._lock:
                for c in batch:
                    c.error, c.done = failure, True
            if not isinstance(err, Exception):
                raise  # KeyboardInterrupt, SystemExit: the leader's thread stops too
            return
        with self._lock:
            for c, answer in zip(batch, answers, strict=True):
                c.answer, c.done = answer, True
