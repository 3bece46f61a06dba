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
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, replace

from turnrl.rollout import Completion, SamplingParams


@dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    n: int
    future: asyncio.Future

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
        self.max_rows, self.window_s = max_rows, window_s
        self._pending: list[_Pending] = []
        self._wake: asyncio.Event | None = None
        self.calls = 0
        self.rows = 0
        self.last_call_s = 0.0
        """Wall time of the latest engine call (bounds how long a burst is gathered)."""

    async def generate(self, prompt: list[int], params: SamplingParams, n: int = 1
                       ) -> tuple[list[Completion], int]:
        """``n`` completions of ``prompt`` and the policy version that sampled them."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(prompt, params, n, future))
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
            try:
                completions, version = await asyncio.to_thread(self._generate, prompts, params)
            except Exception as err:  # noqa: BLE001 - each waiting request gets the error
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(err)
                continue
            at = 0
            for p in batch:
                mine = [cut_to(c, p.params.max_new_tokens) for c in completions[at:at + p.n]]
                at += p.n
                if not p.future.done():
                    p.future.set_result((mine, version))

    def _generate(self, prompts: list[list[int]], params: SamplingParams
                  ) -> tuple[list[Completion], int]:
        with self.weights_lock:
            self.calls += 1
            self.rows += len(prompts)
            started = time.perf_counter()
            completions = self.engine.generate(prompts, params)
            self.last_call_s = time.perf_counter() - started
            return completions, self.engine.version
