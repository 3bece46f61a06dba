"""``rollout.engine auto``: the sampler picked at start-up by timing each candidate here.

Which sampler is fastest depends on the machine (int8 GEMMs, native bf16, memory bandwidth,
core count), the model and the batch: CTranslate2 int8 decodes ~2.5x faster than fp32 torch
on SmolLM2 with 2 threads, but re-reads each episode's whole history every turn where the HF
engine keeps its keys and values. So the candidates are timed on the run's own shape: a batch
of ``group_size x groups_per_step`` rows, one turn and then a second that continues every row
(what a multi-turn episode does), alternating rounds, median of each. A candidate other than
the default must beat it by ``MARGIN``: a shared machine's noise should not switch a run to a
lower precision.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from turnrl.rollout.engine import Engine, SamplingParams

MARGIN = 1.15
"""How much faster (median wall time ratio) a candidate must be than the default to be chosen."""
PROMPT_TOKENS = 48
SECOND_TURN_TOKENS = 12
MAX_ROWS = 64


def pick_fastest(timings: dict[str, list[float]], default: str, margin: float = MARGIN) -> str:
    """The candidate with the smallest median time; ``default`` unless another's median is
    at least ``margin`` times smaller."""
    medians = {name: statistics.median(times) for name, times in timings.items()}
    best = min(medians, key=medians.__getitem__)
    return best if medians[best] * margin <= medians[default] else default


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


def time_engines(builders: dict[str, Callable[[], Engine]], rows: int, vocab_size: int,
                 max_new_tokens: int, rounds: int = 3) -> tuple[dict[str, Engine],
                                                                dict[str, list[float]]]:
    """Build every candidate, warm each up, then time ``rounds`` alternating rounds of
    ``two_turns`` on the same prompts; returns the engines and each one's times."""
    prompts = probe_prompts(min(rows, MAX_ROWS), vocab_size)
    continuation = probe_prompts(1, vocab_size, seed=1)[0][:SECOND_TURN_TOKENS]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    engines = {name: build() for name, build in builders.items()}
    for engine in engines.values():
        two_turns(engine, prompts, params, continuation)  # warm-up (allocations, kernels)
    timings: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            timings[name].append(two_turns(engine, prompts, params, continuation))
    return engines, timings


def describe(chosen: str, timings: dict[str, list[float]], rows: int) -> str:
    """One line for the log: the choice and every candidate's median."""
    medians = ", ".join(f"{name} {statistics.median(times):.2f} s"
                        for name, times in sorted(timings.items(),
                                                  key=lambda item: statistics.median(item[1])))
    return (f"rollout.engine auto: {chosen} (median of two turns x {min(rows, MAX_ROWS)} rows: "
            f"{medians})")
