"""The pieces every side-by-side benchmark shares: alternating rounds, medians, intervals,
the machine line and the final ``ratio:`` line.

Variants run in alternating rounds (A B A B ..., after a warm-up of each) so that a machine
whose load drifts slows every variant alike; a figure is the median over rounds, its spread
the min-max over rounds, and a ratio of medians gets a bootstrap interval over rounds
(rounds resampled as pairs: a round's variants ran next to each other). A benchmark ends with

    machine: <CPU model>, <cores> cores, torch <threads> threads, load <start> -> <end>, <date>
    ratio: <what> = X

Scripts in ``benchmarks/speed|learning|guards/`` import it as a top-level module (their
folder's parent on ``sys.path``, as each script's first lines arrange).
"""

from __future__ import annotations

import datetime
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class HarnessError(RuntimeError):
    """A timed command failed: one line naming the command and what it printed last."""


@dataclass
class Rounds:
    """What ``alternate`` measured: per variant, one entry a round, in round order."""

    order: list[str] = field(default_factory=list)  # the calls as they ran, warm-ups excluded
    wall: dict[str, list[float]] = field(default_factory=dict)  # seconds
    cpu: dict[str, list[float]] = field(default_factory=dict)  # process + children CPU seconds
    results: dict[str, list] = field(default_factory=dict)  # what each call returned

    def medians(self, kind: str = "wall") -> dict[str, float]:
        """The median of each variant's ``wall`` or ``cpu`` seconds."""
        return {name: statistics.median(values) for name, values in getattr(self, kind).items()}


def round_order(names: Sequence[str], rounds: int, flip: bool = False) -> list[str]:
    """The calls of ``rounds`` alternating rounds: A B A B ...; with ``flip`` every other round
    runs in reverse (A B B A A B ...), so no variant always goes first after the other."""
    order: list[str] = []
    for index in range(rounds):
        order += list(reversed(names)) if flip and index % 2 else list(names)
    return order


def cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (a timed command's work)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """``(wall seconds, CPU seconds, return value)`` of one call of ``fn``."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    result = fn()
    return time.perf_counter() - wall, cpu_seconds() - cpu, result


def alternate(variants: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 1,
              flip: bool = False, repeat: int = 1) -> Rounds:
    """Each variant called ``warmup`` times, then ``rounds`` alternating rounds (``round_order``);
    a round's entry is the time of ``repeat`` calls divided by ``repeat`` (short calls)."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    out = Rounds(wall={n: [] for n in variants}, cpu={n: [] for n in variants},
                 results={n: [] for n in variants})
    for name in round_order(list(variants), rounds, flip):
        wall, cpu, result = timed(lambda fn=variants[name]: [fn() for _ in range(repeat)][-1])
        out.order.append(name)
        out.wall[name].append(wall / repeat)
        out.cpu[name].append(cpu / repeat)
        out.results[name].append(result)
    return out


def command(argv: Sequence[str], env: Mapping[str, str] | None = None,
            cwd: str | Path | None = None) -> Callable[[], str]:
    """A callable for ``alternate`` that runs ``argv`` to the end and returns its stdout;
    a non-zero exit raises ``HarnessError`` naming the command and its last stderr line."""
    def run() -> str:
        proc = subprocess.run(list(argv), env=dict(env) if env is not None else None, cwd=cwd,
                              capture_output=True, text=True)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            raise HarnessError(f"{' '.join(map(str, argv))} exited {proc.returncode}: {last}")
        return proc.stdout
    return run


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: Sequence[float]) -> tuple[float, float]:
    """The min-max range of ``values``."""
    return min(values), max(values)


def ratio_of_medians(a: Sequence[float], b: Sequence[float]) -> float:
    """median(a) / median(b); NaN where median(b) is 0."""
    denominator = statistics.median(b)
    return statistics.median(a) / denominator if denominator else float("nan")


def round_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """a / b round by round (each round's two figures ran side by side)."""
    return [x / y if y else float("nan") for x, y in zip(a, b, strict=True)]


def bootstrap_ratio(a: Sequence[float], b: Sequence[float], level: float = 0.95,
                    resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of median(a) / median(b): rounds are drawn with
    replacement as pairs (a round's figures share its load); seeded, so reproducible."""
    if len(a) != len(b) or not a:
        raise ValueError(f"bootstrap needs paired rounds; got {len(a)} and {len(b)}")
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        rows = [rng.randrange(len(a)) for _ in a]
        ratios.append(ratio_of_medians([a[i] for i in rows], [b[i] for i in rows]))
    tail = 100 * (1 - level) / 2
    return percentile(ratios, tail), percentile(ratios, 100 - tail)


def cpu_model(cpuinfo: str) -> str:
    """The CPU's model name from the text of /proc/cpuinfo (x86 ``model name``, else ARM's
    ``Hardware``/``CPU part``); ``unknown CPU`` where none is given."""
    for key in ("model name", "Hardware", "cpu model", "CPU part"):
        for line in cpuinfo.splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key and value.strip():
                return value.strip()
    return "unknown CPU"


def load_average() -> float:
    """The 1-minute load average now (take it at the start; ``machine`` takes the end's)."""
    return os.getloadavg()[0]


def machine_line(cpu: str, cores: int, threads: int | None, load_start: float,
                 load_end: float, date: str) -> str:
    """``machine: CPU, N cores, torch T threads, load S -> E, DATE`` (``threads`` None: the
    benchmark did not load torch)."""
    torch_part = f"torch {threads} threads" if threads is not None else "torch not loaded"
    return (f"machine: {cpu}, {cores} cores, {torch_part}, load {load_start:.2f} -> "
            f"{load_end:.2f}, {date}")


def machine(load_start: float, threads: int | None = None) -> str:
    """The machine line of this machine now, with ``load_start`` from ``load_average()``;
    ``threads``: the torch threads of processes this one started (default: its own torch's,
    where loaded)."""
    try:
        cpu = cpu_model(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = "unknown CPU"
    torch = sys.modules.get("torch")  # torch's thread count, without importing it
    if threads is None and torch is not None:
        threads = torch.get_num_threads()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return machine_line(cpu, os.cpu_count() or 1, threads, load_start, load_average(), date)


def figure(value: float | None, digits: int = 2) -> str:
    """``value`` to ``digits`` decimals for a table; ``-`` where there is none (None, NaN,
    infinite): a run that failed or measured nothing."""
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def ratio_line(what: str, value: float | str) -> str:
    """The last line of a benchmark: ``ratio: <what> = X`` (X to 2 decimals, or a word such
    as ``n/a (TRL not run)`` where no comparison ran)."""
    shown = value if isinstance(value, str) else f"{value:.2f}"
    return f"ratio: {what} = {shown}"


def interval_line(what: str, a: Sequence[float], b: Sequence[float], level: float = 0.95
                  ) -> str:
    """``what = R [lo, hi] (95% bootstrap over N rounds; rounds min-max m-M)``: the ratio
    of medians with its interval and the per-round ratios' range."""
    low, high = bootstrap_ratio(a, b, level)
    least, most = spread(round_ratios(a, b))
    return (f"{what} = {ratio_of_medians(a, b):.2f} [{low:.2f}, {high:.2f}] "
            f"({100 * level:g}% bootstrap over {len(a)} rounds; rounds {least:.2f}-{most:.2f})")
