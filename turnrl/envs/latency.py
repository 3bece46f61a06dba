"""``slow``: any registered environment behind a heavy-tailed, really asynchronous latency.

Real tools (a code sandbox, a web search, a database) answer after a delay that is mostly
short and sometimes very long. ``Slow`` wraps an inner environment and, before delegating each
``step`` (and, with ``on_reset``, each ``reset``), awaits ``asyncio.sleep`` for a log-normal
delay: ``median_ms * exp(sigma * Z)`` with ``Z`` standard normal. ``sigma`` sets the tail: at
the default 1.0 the mean is 1.65 x the median, the 90th percentile 3.6 x and the 99th 10 x,
so with a 500 ms median one step in a hundred takes 5 s. The wait is a real ``await``: other
episodes' steps and (in the continuous rollout loop) generation go on meanwhile, as they
would with a tool call; a turn loop that waits for the slowest step of a batch idles.

Latencies are deterministic: episode ``k`` of this process (in creation order) draws from a
generator seeded by ``(seed, episode seed, k)``, so the episodes of one GRPO group (same
episode seed) still get independent delays, and the same run replays the same delays.
``median_ms: 0`` sleeps never (not even ``sleep(0)``): the inner environment as is.
It is ``cooperative`` (shares the env thread, see ``turnrl.envs.base.Env``) when its inner
environment is: the wait itself never blocks.

Usage: ``--env.name slow --env.options.env guess-number --env.options.median_ms 500``;
options for the inner environment go under ``options``, e.g. ``--env.options.options.high 20``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from typing import Any

from turnrl.envs.base import ENVS, Env, StepResult, make_env, register_env

_instances = itertools.count()
"""Creation index of every ``Slow`` in this process: the per-episode latency stream."""


def lognormal_ms(rng: random.Random, median_ms: float, sigma: float) -> float:
    """One log-normal delay in ms with median ``median_ms`` and shape ``sigma``."""
    if median_ms <= 0:
        return 0.0
    return median_ms * math.exp(sigma * rng.gauss(0.0, 1.0))


@register_env("slow")
class Slow:
    """An inner environment whose steps answer after a log-normal delay (see module doc).

    ``env``: inner environment name; ``options``: its keyword arguments; ``median_ms``: median
    delay (0 = none); ``sigma``: log-normal shape (0 = always exactly the median);
    ``max_ms``: cap on one delay (0 = no cap); ``on_reset``: delay ``reset`` too; ``seed``:
    latency seed; ``stream``: this env's latency stream (default: its creation index in the
    process). ``latencies_ms`` records the delays drawn so far in this episode.
    """

    def __init__(self, env: str = "guess-number", median_ms: float = 100.0, sigma: float = 1.0,
                 max_ms: float = 0.0, on_reset: bool = False, seed: int = 0,
                 options: dict[str, Any] | None = None, stream: int | None = None):
        for name, value in (("median_ms", median_ms), ("sigma", sigma), ("max_ms", max_ms)):
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"slow: {name} must be a finite number >= 0, got {value!r}")
        for name, value in (("seed", seed), ("stream", stream)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"slow: {name} must be an integer, got {value!r}")
        if not isinstance(on_reset, bool):
            raise ValueError(f"slow: on_reset must be true or false, got {on_reset!r}")
        if options is not None and not isinstance(options, dict):
            raise ValueError(f"slow: options must be a mapping of the inner env's keyword "
                             f"arguments, got {options!r}")
        if not isinstance(env, str) or env == "slow":
            raise ValueError(f"slow: env must name another registered environment, got {env!r}")
        if env not in ENVS:
            make_env(env)  # the registry's one-line error, with its "did you mean"
        try:
            self.inner: Env = make_env(env, **(options or {}))
        except ValueError as err:
            raise ValueError(f"slow: {err}") from None
        self.env_name = env
        self.median_ms, self.sigma, self.max_ms = float(median_ms), float(sigma), float(max_ms)
        self.on_reset, self.seed = on_reset, seed
        self.stream = next(_instances) if stream is None else stream
        self.rng = random.Random(f"{seed}/-/{self.stream}")
        self.latencies_ms: list[float] = []

    # ---- what the turn loop looks at besides reset/step: the inner env's ------------------

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes Slow lacks (system_prompt, state_key, max_turns, ...);
        # a missing one stays missing, so getattr(env, "state_key", default) still works.
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---- the Env protocol --------------------------------------------------------------------

    def next_latency_ms(self) -> float:
        """Draw the next delay of this episode (recorded in ``latencies_ms``)."""
        delay = lognormal_ms(self.rng, self.median_ms, self.sigma)
        if self.max_ms:
            delay = min(delay, self.max_ms)
        self.latencies_ms.append(delay)
        return delay

    async def _wait(self) -> None:
        delay = self.next_latency_ms()
        if delay > 0:
            await asyncio.sleep(delay / 1000)

    async def reset(self, seed: int) -> str:
        self.rng = random.Random(f"{self.seed}/{seed}/{self.stream}")
        self.latencies_ms = []
        if self.on_reset:
            await self._wait()
        return await self.inner.reset(seed)

    async def step(self, action: str) -> StepResult:
        await self._wait()
        return await self.inner.step(action)
