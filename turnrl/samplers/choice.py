"""``rollout.sampler auto``: the sampler picked at start-up by timing each candidate here.

Which sampler is fastest depends on the machine (int8 GEMMs, native bf16, memory bandwidth,
core count), the model and the batch: CTranslate2 int8 decodes ~2.5x faster than fp32 torch
on SmolLM2 with 2 threads, but re-reads each episode's whole history every turn where the HF
engine keeps its keys and values. So the candidates are timed on the run's own shape: a batch
of ``group_size x groups_per_step`` rows, one turn and then a second that continues every row
(what a multi-turn episode does).

A lock-step step also pays one weight refresh (``load`` after the update): a ct2
re-conversion, a bf16 copy's tensor copy, nothing for the HF engine on the learner's own
tensors. So each round also times one refresh with the model's own weights, and the choice
compares what a step costs: the sampling time scaled to a step's work plus one refresh
(``step_seconds``), medians of alternating rounds. Async rollout workers refresh off the
sampling path (docs/samplers.md), which is why ``auto`` is the sync sampler only.

A candidate other than the default must beat it by ``MARGIN``: a shared machine's noise
should not switch a run to a lower precision.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from turnrl.samplers.base import Engine, SamplingParams

MARGIN = 1.15
"""How much cheaper (estimated step seconds) a candidate must be than the default to be
chosen."""
PROMPT_TOKENS = 48
SECOND_TURN_TOKENS = 12
MAX_ROWS = 64
MAX_PROBE_TOKENS = 32
PROBE_TURNS = 2


@dataclass(frozen=True)
class Shape:
    """Sampling work: ``rows`` episodes in one batch, ``turns`` generate calls each of up to
    ``new_tokens`` tokens a row."""

    rows: int
    turns: int
    new_tokens: int

    def __str__(self) -> str:
        return f"{self.rows} rows x {self.turns} turns x {self.new_tokens} tokens"


def probe_shape(rows: int, max_new_tokens: int) -> Shape:
    """What the probe samples for a run of ``rows`` rows a step: two turns, rows and new
    tokens capped so that start-up stays short on large batches and long replies."""
    return Shape(min(rows, MAX_ROWS), PROBE_TURNS, min(max_new_tokens, MAX_PROBE_TOKENS))


def step_seconds(sample_s: float, refresh_s: float, probe: Shape, step: Shape) -> float:
    """Estimated seconds a lock-step step spends on its sampler: ``sample_s`` (the probe's
    two turns) scaled by the step's rows, turns and new tokens over the probe's, plus one
    ``refresh_s`` (the ``load`` every step pays after its update).

    The estimate is linear in each factor. It over-counts the work: it assumes every
    episode runs all ``rollout.max_turns`` turns and every reply reaches
    ``rollout.max_new_tokens`` (episodes that end early or replies that stop early make the
    real sampling smaller, and the refresh weigh more). It under-counts ct2's turns: later
    turns carry longer histories than the probe's prompts, which ct2, keeping no keys and
    values, re-reads every turn. It leaves out that a CPU batch past ``MAX_ROWS`` rows
    costs less than linearly more, and the sampling of evaluation, dynamic sampling and
    guidance, none of which pay a refresh.
    """
    scale = (step.rows / probe.rows) * (step.turns / probe.turns) \
        * (step.new_tokens / probe.new_tokens)
    return sample_s * scale + refresh_s


def pick_fastest(step_s: dict[str, float], default: str, margin: float = MARGIN) -> str:
    """The candidate with the smallest estimated step seconds; ``default`` unless another's
    is at least ``margin`` times smaller."""
    best = min(step_s, key=step_s.__getitem__)
    return best if step_s[best] * margin <= step_s[default] else default


def probe_prompts(rows: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``rows`` prompts of ``PROMPT_TOKENS`` ids drawn from the ordinary vocabulary (ids past
    the first 16, clear of the usual special tokens)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(16, vocab_size, (rows, PROMPT_TOKENS), generator=generator)
    return ids.tolist()


def two_turns(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams,
              continuation: Sequence[int]) -> float:
    """Wall seconds of a turn and a second one continuing every row (its reply, then
    ``continuation`` as the environment's answer)."""
    start = time.perf_counter()
    first = engine.generate(prompts, params)
    engine.generate([list(p) + c.token_ids + list(continuation)
                     for p, c in zip(prompts, first, strict=True)], params)
    return time.perf_counter() - start


def timed(action: Callable[[], object]) -> float:
    """Wall seconds of ``action()``."""
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


@dataclass
class Timings:
    """Each candidate's probe times: ``sample_s`` (two turns) and ``refresh_s`` (one
    ``load``), one entry per round."""

    sample_s: dict[str, list[float]]
    refresh_s: dict[str, list[float]]

    def step_s(self, probe: Shape, step: Shape) -> dict[str, float]:
        """Each candidate's ``step_seconds`` from its medians."""
        return {name: step_seconds(statistics.median(self.sample_s[name]),
                                   statistics.median(self.refresh_s[name]), probe, step)
                for name in self.sample_s}


def time_engines(builders: dict[str, Callable[[], Engine]],
                 refresh: Callable[[Engine, int], None], probe: Shape, vocab_size: int,
                 rounds: int = 3) -> tuple[dict[str, Engine], Timings]:
    """Build every candidate, warm each up, then time ``rounds`` alternating rounds of, per
    candidate, ``two_turns`` on the same prompts and one ``refresh(engine, version)`` (the
    refresh after the sampling, so a converter refreshes the temperature it sampled at, as
    in a run); returns the engines and the times."""
    prompts = probe_prompts(probe.rows, vocab_size)
    continuation = probe_prompts(1, vocab_size, seed=1)[0][:SECOND_TURN_TOKENS]
    params = SamplingParams(max_new_tokens=probe.new_tokens, temperature=1.0)
    engines = {name: build() for name, build in builders.items()}
    for engine in engines.values():
        two_turns(engine, prompts, params, continuation)  # warm-up (allocations, kernels)
        refresh(engine, 1)
    timings = Timings({name: [] for name in engines}, {name: [] for name in engines})
    for version in range(2, rounds + 2):
        for name, engine in engines.items():
            timings.sample_s[name].append(two_turns(engine, prompts, params, continuation))
            timings.refresh_s[name].append(timed(partial(refresh, engine, version)))
    return engines, timings


def describe(chosen: str, timings: Timings, probe: Shape, step: Shape) -> str:
    """One line for the log: the choice and every candidate's estimated step seconds, split
    into sampling (scaled from the probe) and one refresh, cheapest first."""
    step_s = timings.step_s(probe, step)
    parts = []
    for name in sorted(step_s, key=step_s.__getitem__):
        refresh_s = statistics.median(timings.refresh_s[name])
        parts.append(f"{name} {step_s[name]:.2f} s = {step_s[name] - refresh_s:.2f} "
                     f"+ {refresh_s:.2f}")
    rounds = len(next(iter(timings.sample_s.values())))
    return (f"rollout.sampler auto: {chosen} (a step = sampling {step} + one weight refresh, "
            f"from medians of {rounds} rounds of {probe}: {', '.join(parts)})")
