"""Concurrent requests -> batched engine calls, one at a time, off the event loop.

Requests queue up; one task takes everything pending that shares sampling settings (up to
``max_rows`` rows), first gathering a burst when the engine was idle (``_gather_burst``) so
that requests sent together share a call, and runs ``engine.generate`` in a thread, so the server keeps accepting
and answering while the engine works. Nothing waits for an agent: a request is served as soon
as it is in a batch, and an agent that is slow to send its next request holds nothing. The
batch's ``max_new_tokens`` is its largest request's; each completion is cut back to its own
request's limit (same distribution, the surplus tokens are discarded).

``weights_lock`` is held for each engine call: a trainer that takes it swaps weights between
calls, never during one, and every completion carries the version it was sampled with.

Live tokens: an engine whose ``generate`` takes ``on_step`` (``HFEngine``) reports each decode
step's tokens from its thread; they are handed to the event loop (``call_soon_threadsafe``,
once per step) and routed to each request's own queue as they are sampled. A request is
answered as soon as all its rows are done (end of turn, or its own ``max_tokens``), not when
the batch's longest request is: a short reply in a batch with a long one does not wait for it.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from dataclasses import dataclass, field, replace

from turnrl.rollout import Completion, SamplingParams


@dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    n: int
    future: asyncio.Future
    stream: asyncio.Queue | None = None
    """Gets ``(choice, token id, logprob)`` as tokens are sampled, then None when done."""
    rows: list[Completion] = field(default_factory=list)
    """Each choice's tokens so far, cut to the request's own ``max_new_tokens``."""

    @property
    def key(self) -> tuple:
        return self.params.temperature, self.params.top_p, self.params.stop_token_ids


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
        self.last_call_s = 0.0
        """Wall time of the latest engine call (bounds how long a burst is gathered)."""

    async def generate(self, prompt: list[int], params: SamplingParams, n: int = 1,
                       stream: asyncio.Queue | None = None) -> tuple[list[Completion], int]:
        """``n`` completions of ``prompt`` and the policy version that sampled them.
        ``stream`` gets ``(choice, token id, logprob)`` as each token is sampled (all at the
        end for an engine without live tokens), then None once the completions are final."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(prompt, params, n, future, stream))
        if self._wake is not None:
            self._wake.set()
        return await future

    def _take(self) -> list[_Pending]:
        """The oldest request and every later one with its settings, within ``max_rows``."""
        key, rows, batch, rest = self._pending[0].key, 0, [], []
        for p in self._pending:
            if p.key == key and (not batch or rows + p.n <= self.max_rows):
                batch.append(p)
                rows += p.n
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
            batch = [p for p in self._take() if not p.future.cancelled()]
            if not batch:
                continue
            prompts = [p.prompt for p in batch for _ in range(p.n)]
            params = replace(batch[0].params,
                             max_new_tokens=max(p.params.max_new_tokens for p in batch))
            owners = [(p, j) for p in batch for j in range(p.n)]  # each engine row's request
            for p in batch:
                p.rows = [Completion() for _ in range(p.n)]
            try:
                completions, version = await asyncio.to_thread(
                    self._generate, prompts, params, owners, asyncio.get_running_loop())
            except Exception as err:  # noqa: BLE001 - each waiting request gets the error
                for p in batch:
                    _finish(p, err)
                continue
            for row, ((p, j), completion) in enumerate(zip(owners, completions, strict=True)):
                have = len(p.rows[j].token_ids)  # all of it where the engine has live tokens
                rest = zip(completion.token_ids[have:], completion.logprobs[have:], strict=True)
                self._deliver(version, [(row, t, lp) for t, lp in rest], owners)
            for p in batch:  # anything still open ended with the batch
                _finish(p, (p.rows, version))

    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  owners: list[tuple[_Pending, int]], loop: asyncio.AbstractEventLoop
                  ) -> tuple[list[Completion], int]:
        with self.weights_lock:
            self.calls += 1
            self.rows += len(prompts)
            version = self.engine.version
            started = time.perf_counter()
            if self.live_tokens:
                def on_step(tokens: list[tuple[int, int, float]]) -> None:
                    loop.call_soon_threadsafe(self._deliver, version, tokens, owners)

                completions = self.engine.generate(prompts, params, on_step=on_step)
            else:
                completions = self.engine.generate(prompts, params)
            self.last_call_s = time.perf_counter() - started
            return completions, version

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
            mine.token_ids.append(token)
            mine.logprobs.append(logprob)
            if token in p.params.stop_token_ids:
                mine.finish_reason = "stop"
            if p.stream is not None:
                p.stream.put_nowait((j, token, logprob))
            touched[id(p)] = p
        for p in touched.values():
            if all(_row_done(c, p.params) for c in p.rows):
                _finish(p, (p.rows, version))


def _row_done(row: Completion, params: SamplingParams) -> bool:
    return row.finish_reason == "stop" or len(row.token_ids) >= params.max_new_tokens


def _finish(p: _Pending, outcome: tuple[list[Completion], int] | Exception) -> None:
    """Answer ``p`` once (a result or an error) and close its token stream."""
    if p.future.done():
        return
    if isinstance(outcome, Exception):
        p.future.set_exception(outcome)
    else:
        p.future.set_result(outcome)
    if p.stream is not None:
        p.stream.put_nowait(None)
