"""Crash-safe metrics logging, a terminal progress bar, and a results table.

``metrics.jsonl`` holds one JSON object per training step: ``{"step", "time", **metrics}``.
Each line is flushed and fsync'ed as it is written, so a ``kill -9`` loses at most the line
being written; that torn last line is skipped by :func:`read_metrics` and cut off when a
:class:`MetricsLogger` reopens the file. JSON has no NaN/Infinity, so non-finite values are
written as ``null`` (reading them back gives ``None``).
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from turnrl.config.types import ConfigError
from turnrl.safe_json import safe_text
from turnrl.tracking import Tracker, open_tracker

__all__ = [
    "METRICS_FILE",
    "MetricsLogger",
    "TrainProgress",
    "fsync_dir",
    "print_table",
    "read_metrics",
    "truncate_metrics",
]

METRICS_FILE = "metrics.jsonl"
_RESERVED = frozenset({"step", "time"})


# --------------------------------------------------------------------------- jsonl logging


def _warn(message: str) -> None:
    print(f"turnrl: warning: {message}", file=sys.stderr)


def _clean_value(value: Any) -> Any:
    """Make a metric JSON-safe: unwrap tensor/numpy scalars, turn NaN/inf into None."""
    if hasattr(value, "item"):  # 0-d torch tensors and numpy scalars
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):  # more than one element: text below
            pass
    if value is None or isinstance(value, bool | int | str):
        return value
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):  # not a number: kept as bounded text
        return safe_text(value, 200)
    return value if math.isfinite(value) else None


def fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (best effort where unsupported)."""
    # Makes a rename durable on POSIX; directories cannot be opened this way on Windows.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _drop_torn_tail(path: Path) -> None:
    """Cut an unterminated last line, so appending after a crash does not glue onto it."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    os.truncate(path, data.rfind(b"\n") + 1)


def _parse_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Return (raw line, record) pairs; a torn last line is skipped, other corruption raises."""
    # errors="replace": a crash can split a multi-byte character; that line is dropped anyway.
    lines = [
        ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()
    ]
    parsed = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            if i == len(lines) - 1:
                break  # torn by a crash mid-write
            raise ValueError(f"{path}:{i + 1}: corrupt metrics line")
        parsed.append((line, record))
    return parsed


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics.jsonl file (or a run directory containing one) into a list of dicts."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return [record for _, record in _parse_lines(path)]


def truncate_metrics(path: str | Path, after_step: int) -> None:
    """Atomically keep only records with ``step <= after_step``; a missing file is a no-op.

    Call this when resuming from a checkpoint, *before* opening a :class:`MetricsLogger` on
    the same run: the file is replaced by rename, so an already open logger would keep
    appending to the old, unlinked file.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        return
    kept = [
        line
        for line, rec in _parse_lines(path)
        if isinstance(rec.get("step"), int | float) and rec["step"] <= after_step
    ]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _optional_tracker(name: str, run_dir: Path, project: str, config: dict | None
                      ) -> Tracker | None:
    """``run.tensorboard`` / ``run.wandb``: the tracker when its package is installed, else
    one warning line and None (``run.tracking`` names fail instead)."""
    try:
        return open_tracker(name, run_dir, project, config)
    except ConfigError:
        _warn(f"{name} requested but not installed (pip install {name}); skipping it")
        return None


class MetricsLogger:
    """Append per-step metrics to ``run_dir/metrics.jsonl``, optionally mirrored elsewhere.

    ``tracking`` names trackers that must work (``turnrl/tracking.py``: trackio, mlflow,
    tensorboard, wandb, prometheus on ``metrics_port``; a missing one fails in one line
    naming the ``tracking`` extra).
    ``tensorboard`` / ``wandb`` are the softer switches: when requested but not installed,
    one warning line is printed and logging carries on.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "turnrl",
        config: dict | None = None,
        tracking: Sequence[str] = (),
        metrics_port: int = 0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        soft = [name for name, on in (("tensorboard", tensorboard), ("wandb", wandb))
                if on and name not in tracking]
        self._trackers: list[Tracker] = []
        try:  # the required ones first: a missing one fails before anything is opened
            for name in dict.fromkeys(tracking):
                self._trackers.append(open_tracker(name, self.run_dir, wandb_project, config,
                                                   metrics_port))
        except BaseException:
            self._close_trackers()
            raise
        self._trackers += filter(None, (_optional_tracker(name, self.run_dir, wandb_project,
                                                          config) for name in soft))
        _drop_torn_tail(self.path)
        self._file: io.TextIOWrapper | None = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Durably append one record; returns only after it has reached the disk."""
        if self._file is None:
            raise RuntimeError("MetricsLogger is closed")
        clash = _RESERVED.intersection(metrics)
        if clash:
            raise ValueError(f"metric names {sorted(clash)} are reserved")
        record = {"step": int(step), "time": time.time()}
        record.update({str(k): _clean_value(v) for k, v in metrics.items()})
        # Serialise fully before writing, so a bad value cannot leave half a line behind.
        line = json.dumps(record, allow_nan=False) + "\n"
        self._file.write(line)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._mirror(int(step), record)

    def _mirror(self, step: int, record: dict[str, Any]) -> None:
        scalars = {
            k: v
            for k, v in record.items()
            if k not in _RESERVED and isinstance(v, int | float) and not isinstance(v, bool)
        }
        for tracker in self._trackers:
            tracker.log(step, scalars)

    def close(self) -> None:
        """Close the file and any mirrors; safe to call more than once."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._close_trackers()

    def _close_trackers(self) -> None:
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --------------------------------------------------------------------------- progress display


def _format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _format_number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


class TrainProgress:
    """Training progress: ``step i/N``, a bar, mean reward, episode length, step time, ETA.

    ``update(step, reward=..., length=..., step_s=...)``; ``tokens=`` or ``turns=`` may be
    passed instead of ``length=`` and also set its unit; ``step_s`` defaults to the measured
    time since the previous update. Other keyword fields are shown as
    ``name=value``. On a terminal this is a live rich bar; otherwise (CI, redirected output)
    a plain line is printed every ``plain_every`` steps, since a redrawn bar would be lost.
    ETA is the mean time per step since the bar started times the steps left; rich's own
    estimate uses a 30 s window and shows nothing once steps take longer than that.
    """

    def __init__(
        self,
        total: int,
        *,
        description: str = "train",
        enabled: bool = True,
        start_step: int = 0,
        length_unit: str = "tokens",
        plain_every: int | None = None,
        console: Console | None = None,
    ) -> None:
        self.total = total
        self.description = description
        self.enabled = enabled
        self.start_step = start_step
        self.length_unit = length_unit
        self.plain_every = plain_every or max(1, total // 20)
        self.console = console if console is not None else Console()
        self._progress: Progress | None = None
        self._task: Any = None
        self._started_at = 0.0
        self._last: tuple[int, float] | None = None  # (step, time) of the previous update
        self._fields: dict[str, Any] = {}

    def start(self) -> TrainProgress:
        if not self.enabled:
            return self
        self._started_at = time.monotonic()
        self._last = (self.start_step, self._started_at)
        if self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                self.description, total=self.total, completed=self.start_step, stats=""
            )
        return self

    def update(self, step: int, **fields: Any) -> None:
        """Record that ``step`` steps are done, with the latest per-step statistics."""
        if not self.enabled:
            return
        for unit in ("tokens", "turns"):
            if unit in fields:
                self.length_unit = unit
                fields["length"] = fields.pop(unit)
        now = time.monotonic()
        if "step_s" not in fields and self._last is not None and step > self._last[0]:
            # Measured here when the caller does not time its steps itself.
            fields["step_s"] = (now - self._last[1]) / (step - self._last[0])
        self._last = (step, now)
        self._fields.update(fields)
        stats = self._stats_text(step)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=stats)
        elif step % self.plain_every == 0 or step >= self.total:
            self.console.print(
                f"{self.description} step {step}/{self.total} | {stats}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )

    def _stats_text(self, step: int) -> str:
        f = dict(self._fields)
        parts = []
        if f.get("reward") is not None:
            parts.append(f"reward {_format_number(f.pop('reward'))}")
        if f.get("length") is not None:
            parts.append(f"len {_format_number(f.pop('length'))} {self.length_unit}")
        if f.get("step_s") is not None:
            parts.append(f"{_format_number(f.pop('step_s'))} s/step")
        parts += [f"{k}={_format_number(v)}" for k, v in f.items() if v is not None]
        parts.append(f"ETA {self._eta(step)}")
        return " | ".join(parts)

    def _eta(self, step: int) -> str:
        done = step - self.start_step
        if done <= 0:
            return "-:--:--"
        per_step = (time.monotonic() - self._started_at) / done
        return _format_duration(per_step * max(0, self.total - step))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> TrainProgress:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --------------------------------------------------------------------------- tables


def _plain_text(renderable: Any) -> str:
    # A wide, colourless, non-terminal console renders without wrapping or escape codes.
    buffer = io.StringIO()
    Console(file=buffer, width=1000, color_system=None, force_terminal=False).print(renderable)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"


def print_table(
    title: str,
    columns: list[str],
    rows: list[list[str]],
    *,
    console: Console | None = None,
) -> str:
    """Print a rich table and return the same table as plain text (for saving to a file)."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    (console if console is not None else Console()).print(table)
    return _plain_text(table)
