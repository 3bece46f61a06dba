"""Concurrent requests -> batched engine calls, one at a time, off the event loop.

Requests queue up; one task takes everything pending that shares sampling settings (up to
``max_rows`` rows), first gathering a burst when the engine was idle (``_gather_burst``) so
that requests sent together share a call, and runs ``engine.generate`` in a thread, so the
server keeps accepting and answering while the engine works. Nothing waits for an agent: a
request is served as soon as it is in a batch, and an agent that is slow to send its next
request holds nothing. The batch's ``max_new_tokens`` is its largest request's; each reply
is cut at its own request's limit (same distribution, the surplus tokens are discarded).

``weights_lock`` is held for each engine call: a trainer that takes it swaps weights between
calls, never during one, and every completion carries the version it was sampled with.

Live tokens, with an engine whose ``generate`` takes ``on_step`` (``HFEngine``):

- Each decode step's tokens are handed from the engine's thread to the event loop (one
  ``call_soon_threadsafe`` a step) and routed to their requests as they are sampled: a
  streaming request's queue gets them at once, and a request is answered as soon as its own
  rows are done (end of turn or its ``max_tokens``), not when the batch's longest one is.
- A request that arrives while a batch decodes joins at the next step: the engine stops
  after the step (the hook returns True when the oldest waiting request could share the
  batch: same settings, room within ``max_rows``),
  and the next call continues every unfinished row together with the newcomers. The
  engine's kept keys and values make the continuation cheap (one new token to prefill per
  row), so a long request delays others' first tokens by about a step, not by its length.
  A reply whose continuation is sampled by other weights (a trainer took the lock in
  between) is served with version None: tokens of two policies, not recorded.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from dataclasses import dataclass, field, replace

from turnrl.samplers import Completion, SamplingParams


@dataclass(eq=False)
class _Pending:
    prompt: list[int]
    params: SamplingParams
    n: int
    future: asyncio.Future
    stream: asyncio.Queue | None = None
    """Gets ``(choice, token id, logprob)`` as tokens are sampled, then None when done."""
    rows: list[Completion] = field(default_factory=list)
    """Each choice's tokens so far, never beyond the request's own ``max_new_tokens``."""
    version: int | None = None
    mixed: bool = False
    """Sampled by two policy versions (continued after a weight update)."""

    def __post_init__(self):
        self.rows = [Completion() for _ in range(self.n)]

    @property
    def key(self) -> tuple:
        return self.params.temperature, self.params.top_p, self.params.stop_token_ids

    def open_rows(self) -> list[int]:
        return [j for j, row in enumerate(self.rows) if not _row_done(row, self.params)]


def _row_done(row: Completion, params: SamplingParams) -> bool:
    return row.finish_reason == "stop" or len(row.token_ids) >= params.max_new_tokens


def cut_to(completion: Completion, max_new_tokens: int) -> Completion:
    """``completion`` as a call with a lower ``max_new_tokens`` would have ended."""
    if len(completion.token_ids) <= max_new_tokens:
        return completion
    return Completion(completion.token_ids[:max_new_tokens],
                      completion.logprobs[:max_new_tokens], "length")


class Batcher:
    def __init__(self, engine, weights_lock: threading.Lock, max_rows: int = 64,
                 window_s: float = 0.005):
        self.engine, self.weights_lock = engine, weights_lock
        self.live_tokens = "on_step" in inspect.signature(engine.generate).parameters
        """Whether the engine reports tokens as it samples them (else all come at the end)."""
        self.max_rows, self.window_s = max_rows, window_s
        self._pending: list[_Pending] = []
        self._wake: asyncio.Event | None = None
        self.calls = 0
        self.rows = 0
        self.join_running = True
        """Let a waiting request stop a running call to join it (off: it waits its end)."""
        self.joins = 0
        """Engine calls stopped early so that waiting requests join the batch."""
        self.continued = 0
        """Rows fed again after such a stop (``rows`` counts them once more each time)."""
        self.last_call_s = 0.0
        """Wall time of the latest engine call (bounds how long a burst is gathered)."""
        self.last_call_end = 0.0
        """``time.perf_counter()`` when the latest engine call returned."""

    @property
    def waiting(self) -> int:
        """Choices queued for the engine and not yet answered (``/metrics``' queue depth)."""
        return sum(p.n for p in list(self._pending) if not p.future.done())

    async def generate(self, prompt: list[int], params: SamplingParams, n: int = 1,
                       stream: asyncio.Queue | None = None
                       ) -> tuple[list[Completion], int | None]:
        """``n`` completions of ``prompt`` and the policy version that sampled them (None:
        two versions did). ``stream`` gets ``(choice, token id, logprob)`` as each token is
        sampled (all at the end for an engine without live tokens), then None."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(prompt, params, n, future, stream))
        if self._wake is not None:
            self._wake.set()
        return await future

    def _take(self) -> list[_Pending]:
        """The oldest request and every later one with its settings, within ``max_rows``."""
        key, rows, batch, rest = self._pending[0].key, 0, [], []
        for p in self._pending:
            if p.key == key and (not batch or rows + len(p.open_rows()) <= self.max_rows):
                batch.append(p)
                rows += len(p.open_rows())
            else:
                rest.append(p)
        self._pending = rest
        return batch

    async def _gather_burst(self) -> None:
        """Requests sent together arrive spread out (each is parsed and rendered in turn):
        wait in ``window_s`` steps while more keep arriving, at most a quarter of the last
        engine call's measured time (the extra latency stays small next to a call)."""
        waited, seen = 0.0, -1
        cap = max(self.window_s, 0.25 * self.last_call_s)
        while (len(self._pending) != seen and waited < cap
               and sum(p.n for p in self._pending) < self.max_rows):
            seen = len(self._pending)
            await asyncio.sleep(self.window_s)
            waited += self.window_s

    async def run(self) -> None:
        self._wake = asyncio.Event()
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                await self._gather_burst()
            batch = [p for p in self._take() if not p.future.done()]
            if not batch:
                continue
            # One engine row per unfinished choice, continuing from what it has sampled.
            owners = [(p, j) for p in batch for j in p.open_rows()]
            prompts = [p.prompt + p.rows[j].token_ids for p, j in owners]
            params = replace(batch[0].params, max_new_tokens=max(
                p.params.max_new_tokens - len(p.rows[j].token_ids) for p, j in owners))
            before = [len(p.rows[j].token_ids) for p, j in owners]
            self.continued += sum(1 for n in before if n)
            try:
                completions, version, stopped_early = await asyncio.to_thread(
                    self._generate, prompts, params, owners, asyncio.get_running_loop())
            except Exception as err:  # noqa: BLE001 - each waiting request gets the error
                for p in batch:
                    _finish(p, err)
                continue
            for row, ((p, j), completion) in enumerate(zip(owners, completions, strict=True)):
                have = len(p.rows[j].token_ids) - before[row]  # all, with live tokens
                rest = zip(completion.token_ids[have:], completion.logprobs[have:], strict=True)
                self._deliver(version, [(row, t, lp) for t, lp in rest], owners)
            unfinished = [p for p in batch if not p.future.done()]
            if stopped_early:  # continue them first, with whoever joins
                self._pending[:0] = unfinished
            else:
                for p in unfinished:
                    _finish(p)

    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  owners: list[tuple[_Pending, int]], loop: asyncio.AbstractEventLoop
                  ) -> tuple[list[Completion], int, bool]:
        with self.weights_lock:
            self.calls += 1
            self.rows += len(prompts)
            version = self.engine.version
            started = time.perf_counter()
            stopped_early = False
            if self.live_tokens:
                key = owners[0][0].key

                def on_step(tokens: list[tuple[int, int, float]]) -> bool:
                    nonlocal stopped_early
                    loop.call_soon_threadsafe(self._deliver, version, tokens, owners)
                    stopped_early = self._someone_waits(key, len(tokens))
                    return stopped_early

                completions = self.engine.generate(prompts, params, on_step=on_step)
            else:
                completions = self.engine.generate(prompts, params)
            self.joins += stopped_early
            self.last_call_end = time.perf_counter()
            self.last_call_s = self.last_call_end - started
            return completions, version, stopped_early

    def _someone_waits(self, key: tuple, live_rows: int) -> bool:
        """(On the engine's thread.) Whether the oldest waiting request could share the
        batch: then the engine stops after this step and the next call takes it in. (Not
        any waiting one: a request with other settings, waiting first, goes next.)"""
        waiting = [p for p in list(self._pending) if not p.future.done()]
        return (self.join_running and live_rows > 0 and bool(waiting)
                and waiting[0].key == key and live_rows + waiting[0].n <= self.max_rows)

    @staticmethod
    def _deliver(version: int, tokens: list[tuple[int, int, float]],
                 owners: list[tuple[_Pending, int]]) -> None:
        """On the event loop: route one step's tokens to their requests; answer each request
        whose rows are all done (its end of turn, or its own ``max_new_tokens``)."""
        touched = {}
        for row, token, logprob in tokens:
            p, j = owners[row]
            mine = p.rows[j]
            if p.future.done() or _row_done(mine, p.params):
                continue
            if p.version is None:
                p.version = version
            p.mixed |= p.version != version
            mine.token_ids.append(token)
            mine.logprobs.append(logprob)
            if token in p.params.stop_token_ids:
                mine.finish_reason = "stop"
            if p.stream is not None:
                p.stream.put_nowait((j, token, logprob))
            touched[id(p)] = p
        for p in touched.values():
            if not p.open_rows():
                _finish(p)


def _finish(p: _Pending, error: Exception | None = None) -> None:
    """Answer ``p`` once (its rows and version, or an error) and close its token stream."""
    if p.future.done():
        return
    if error is not None:
        p.future.set_exception(error)
    else:
        p.future.set_result((p.rows, None if p.mixed else p.version))
    if p.stream is not None:
        p.stream.put_nowait(None)
