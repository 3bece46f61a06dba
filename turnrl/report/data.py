"""What a report reads from a run directory, read so that any run directory can be drawn.

A run killed before its first step has a ``config.yaml`` and no ``metrics.jsonl``; one
killed mid-write has a torn last line; a file edited by hand may have a bad line anywhere.
The report draws what it can and says what it left out (:class:`Metrics` ``notes``);
only a path that is no run directory at all is an error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnrl.metrics import METRICS_FILE

__all__ = ["Metrics", "finite", "read_run_metrics", "require_run_dir"]


def finite(value: Any) -> float | None:
    """``value`` as a finite float; None for NaN, inf, None, bools, text, or an int past float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # a JSON integer too long for a float
        return None
    return number if math.isfinite(number) else None


@dataclass
class Metrics:
    """The readable records of ``metrics.jsonl``, each with a finite ``step``."""

    records: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was left out and why, one line each, for the page."""


def require_run_dir(run_dir: str | Path) -> Path:
    """``run_dir`` as a Path; FileNotFoundError, naming the fix, if it is no run directory.

    A run directory has a ``metrics.jsonl`` or a ``config.yaml`` (a run stopped before its
    first step has only the latter).
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"no run directory {path}; pass the --run.out_dir of a "
                                "`turnrl train` run")
    if not (path / METRICS_FILE).is_file() and not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} (nor config.yaml) in {path}; is this a "
                                "TurnRL run directory? pass the --run.out_dir of `turnrl train`")
    return path


def _lines(path: Path) -> list[str] | str:
    """The non-blank lines of ``path``, or why it cannot be read."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        return f"{path.name} could not be read ({err.strerror or err})"
    return [line for line in text.splitlines() if line.strip()]


def read_run_metrics(run_dir: Path) -> Metrics:
    """Every record of ``run_dir/metrics.jsonl`` that is a JSON object with a finite step.

    Unlike :func:`turnrl.metrics.read_metrics` (which a resume trusts, so it raises on a
    corrupt line), a report skips bad lines and notes them: a picture with a gap beats none.
    """
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return Metrics(notes=[f"no {METRICS_FILE} yet: the run stopped (or is still) before "
                              "its first step"])
    lines = _lines(path)
    if isinstance(lines, str):
        return Metrics(notes=[lines])
    out, unreadable, stepless = Metrics(), [], 0
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            unreadable.append(number)
        elif finite(record.get("step")) is None:
            stepless += 1
        else:
            out.records.append(record)
    if unreadable == [len(lines)]:
        out.notes.append(f"{METRICS_FILE}: its last line is cut short (a run writing it, or "
                         "killed mid-write); left out")
    elif unreadable:
        shown = ", ".join(map(str, unreadable[:5])) + (", ..." if len(unreadable) > 5 else "")
        out.notes.append(f"{METRICS_FILE}: {len(unreadable)} unreadable line(s) left out "
                         f"(line {shown})")
    if stepless:
        out.notes.append(f"{METRICS_FILE}: {stepless} record(s) without a numeric step left out")
    return out
