"""Weight refresh off the sampling path: a ``CT2Engine`` keeps sampling with the model it has
while a thread of its own converts the next version (async rollout workers, ``rollout.sampler ct2``).

In lock-step the conversion (~0.9 s for SmolLM2 int8 on an idle machine) sits between the
update and the next collection, and costs more than int8 sampling saves. An async worker
need not wait: the learner only asks it for *some* recent version. So:

- ``offer(version, payload)`` (any thread; the worker's ``set_weights``) remembers the newest
  version sent and wakes the converter. Versions superseded before the converter gets to
  them are never fetched nor converted.
- The converter thread fetches the payload (``fetch``: the worker's object-store read), has
  the engine ``build`` a loaded CTranslate2 model of it and parks it as *ready*; a newer
  ready model replaces an older one not yet swapped in.
- ``swap()`` runs in the generation thread before each generate call (the turn loop's
  ``before_generate``): it adopts the ready model, if any, and with it the engine's version.
  The model and its version change together, between generate calls, in the thread that
  samples, so the version the loop tags a call's tokens with (read right after) is the one
  whose model sampled them. It blocks only before the first version (nothing to sample with).
- A conversion that fails is kept and raised by the next ``swap`` (the turn loop stops with
  it) and by ``check`` (the worker's next report), with the version and the reason: the
  learner stops naming them, never a worker that silently samples an old version on, nor a
  hang.

Measured (``stats``): each conversion's wall seconds (fetch included) and the converter
thread's own CPU seconds (CTranslate2's and torch's pools not counted), the seconds sampling
waited on a refresh after the first (the swap alone: should be ~0), the wait for the first
version apart, and conversions replaced by a newer one before any call sampled them.

``TURNRL_CT2_CONVERT_DELAY_S`` (a test hook, seconds) makes every conversion that much
slower, to show that sampling goes on meanwhile with the previous version.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from turnrl import leftovers
from turnrl.samplers.ct2 import CT2Engine, converted_temperature

DELAY_ENV = "TURNRL_CT2_CONVERT_DELAY_S"
"""Test hook: extra seconds added to every background conversion."""


class SamplingStopped(RuntimeError):
    """``swap`` was asked to stop before any version had been converted."""


class BackgroundRefresh:
    """Converts each offered weight version for ``engine`` in a background thread; see the
    module docstring. ``fetch(payload)`` turns what ``offer`` was given into a state dict
    (runs in the converter thread); ``temperature`` is the sampling temperature of the calls
    the engine serves (one converted model per version)."""

    def __init__(self, engine: CT2Engine, temperature: float,
                 fetch: Callable[[Any], Any] = lambda payload: payload, *,
                 delay_s: float | None = None, name: str = "ct2-refresh") -> None:
        self.engine = engine
        self.temperature = converted_temperature(temperature)
        self.fetch = fetch
        self.delay_s = float(os.environ.get(DELAY_ENV, 0) or 0) if delay_s is None else delay_s
        self._changed = threading.Condition()
        self._offered: tuple[int, Any] | None = None
        self._taken = -1
        """Newest version the converter has started on."""
        self._ready: tuple[int, Any, Any] | None = None
        """(version, weights, loaded model) converted and not yet swapped in."""
        self._error: str | None = None
        self._closed = False
        self.totals = {"conversions": 0, "convert_s": 0.0, "convert_cpu_s": 0.0,
                       "convert_max_s": 0.0, "unused": 0, "swaps": 0, "wait_s": 0.0,
                       "wait_max_s": 0.0, "first_wait_s": 0.0}
        self._thread = threading.Thread(target=self._convert_forever, name=name, daemon=True)
        self._thread.start()

    # ---- any thread -----------------------------------------------------------------------

    def offer(self, version: int, payload: Any) -> None:
        """Convert ``version`` (its weights: ``fetch(payload)``) once the converter is free,
        unless a newer one is offered first."""
        with self._changed:
            if self._offered is None or version > self._offered[0]:
                self._offered = (version, payload)
                self._changed.notify_all()

    def check(self) -> None:
        """Raise a failed conversion's error (the worker's next report carries it, whether or
        not a generate call has run into it)."""
        with self._changed:
            if self._error is not None:
                raise RuntimeError(self._error)

    def stats(self) -> dict[str, float]:
        """Running totals (``refresh_*`` in the worker's report)."""
        with self._changed:
            return {f"refresh_{key}": float(value) for key, value in self.totals.items()}

    def close(self) -> None:
        """Stop the converter after the conversion in progress (never joined: a SmolLM2
        conversion takes seconds, and the thread is a daemon)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    # ---- the generation thread ------------------------------------------------------------

    def swap(self, stopping: Callable[[], bool] = lambda: False) -> None:
        """Before a generate call: sample with the newest converted version from now on.
        Blocks only while nothing has been converted yet; raises a conversion's failure."""
        started = time.perf_counter()
        first = self.engine.version < 0
        with self._changed:
            while first and self._ready is None and self._error is None:
                if stopping():
                    raise SamplingStopped("stopped before the first weights were converted")
                self._changed.wait(0.1)
            if self._error is not None:
                raise RuntimeError(self._error)
            ready, self._ready = self._ready, None
        swapped = ready is not None
        if swapped:
            version, weights, model = ready
            self.engine.adopt(weights, version, self.temperature, model)
            del ready, model  # the previous model is freed here, counted in the wait
        waited = time.perf_counter() - started
        with self._changed:
            if first:
                self.totals["first_wait_s"] += waited
            else:
                self.totals["wait_s"] += waited
                self.totals["wait_max_s"] = max(self.totals["wait_max_s"], waited)
            self.totals["swaps"] += swapped

    # ---- the converter thread -------------------------------------------------------------

    def _convert_forever(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed or (
                    self._offered is not None and self._offered[0] > self._taken))
                if self._closed:
                    return
                version, payload = self._offered
                self._offered = (version, None)  # the payload is not kept past its use
                self._taken = version
            try:
                with leftovers.busy("the ct2 weight conversion"):  # an exit waits for it
                    model, weights, wall, cpu = self._convert(payload)
            except Exception as err:  # noqa: BLE001 - reported by swap, in the sampling path
                with self._changed:
                    self._error = (f"ct2 conversion of weights version {version} failed: "
                                   f"{type(err).__name__}: {_one_line(err)}")
                    self._changed.notify_all()
                return
            with self._changed:
                self.totals["unused"] += self._ready is not None  # converted, never sampled
                self._ready = (version, weights, model)
                self.totals["conversions"] += 1
                self.totals["convert_s"] += wall
                self.totals["convert_cpu_s"] += cpu
                self.totals["convert_max_s"] = max(self.totals["convert_max_s"], wall)
                self._changed.notify_all()

    def _convert(self, payload: Any) -> tuple[Any, Any, float, float]:
        """(loaded model, weights, wall s, this thread's CPU s) of one version."""
        started, cpu = time.perf_counter(), time.thread_time()
        weights = self.fetch(payload)
        model = self.engine.build(weights, self.temperature)
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        return model, weights, time.perf_counter() - started, time.thread_time() - cpu


def _one_line(err: BaseException) -> str:
    """The error's message on one line (torch puts the useful part of a state-dict error on
    its second), at most 300 characters."""
    return " ".join(str(err).split())[:300] or "no message"
