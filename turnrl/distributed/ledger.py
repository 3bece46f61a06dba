"""``assignments.jsonl``: an async run's account of its work, one line per step: which
(assignment, seed) pairs were trained on and which were dropped, regenerated or re-issued,
worker restarts and the weight bytes each node pulled; and the run's totals of the same, for
its result (``AsyncTrainResult``, source.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TextIO

from turnrl.metrics import truncate_metrics
from turnrl.rollout.loop import Group

LEDGER_FILE = "assignments.jsonl"


class Ledger:
    """The step's events, the ledger's stream and the run's totals."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else io.StringIO()
        self.step_events: dict[str, list[int]] = {"regenerated": []}
        self.trained: list[tuple[int, int]] = []
        self.totals = {"reissued": [], "regenerated": [], "filtered": [], "restarts": 0,
                       "duplicates": 0}

    def open(self, run_dir: Path, resumed: bool, start_step: int) -> None:
        """Append to the run's ledger: a fresh run's starts empty, a resumed run's loses the
        lines after its checkpoint's step."""
        path = run_dir / LEDGER_FILE
        if not resumed:
            path.unlink(missing_ok=True)
        truncate_metrics(path, after_step=start_step)
        self.stream = open(path, "a")  # noqa: SIM115 - closed by close()

    def record(self, step: int, groups: list[Group], dropped: list[int], fleet, book,
               pulled: dict[str, int]) -> None:
        """Step ``step``'s line: ``groups`` trained (resolved in ``book``), the events since
        the last step (the fleet's and the book's counts, reset here)."""
        for g in groups:
            book.resolve(g.assignment, "trained")
            self.trained.append((g.assignment, g.seed))
        events = self.step_events
        self.stream.write(json.dumps({
            "step": step + 1, "trained": [[g.assignment, g.seed, g.worker] for g in groups],
            "dropped": dropped, **events, "reissued": fleet.reissued,
            "worker_restarts": fleet.restarts, "weights_bytes_by_node": pulled}) + "\n")
        self.stream.flush()
        self.totals["reissued"] += fleet.reissued
        self.totals["regenerated"] += events["regenerated"]
        self.totals["filtered"] += events.get("filtered", [])
        self.totals["restarts"] += fleet.restarts
        self.totals["duplicates"] += book.duplicates
        fleet.reissued, fleet.restarts, book.duplicates = [], 0, 0
        self.step_events = {"regenerated": []}

    def close(self) -> None:
        self.stream.close()
