"""Sample requests that wait in the service's queue together, for the same weights, prompt and
sampling parameters, are drawn in one call (a recipe sends each env of a group alone, with
``num_samples=1``): n rows of one prompt need no padding, so the draw is the one ``sampling``
already makes, and each row is still scored alone, its log-probs exactly ``forward``'s.

Order is kept: a request is merged only with later ones of its *run*, the sample requests
queued since the last request of any other kind (a ``save_weights_for_sampler`` may rewrite
a path, an ``optim_step`` may precede a save), and only with those not started. A request
with a seed (the same seed must give the same tokens) or asking for prompt log-probs is
drawn alone.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass(eq=False)
class Pending:
    """One queued sample request; ``result`` is set by whichever job draws it."""

    body: dict
    key: tuple | None
    run: list[Pending]
    taken: bool = False
    result: Future = field(default_factory=Future)


def merge_key(body: dict, target: str) -> tuple | None:
    """What requests must share to be drawn together; None: drawn alone."""
    params = body.get("sampling_params") or {}
    if params.get("seed") is not None or body.get("prompt_logprobs"):
        return None
    prompt = tuple(t for chunk in body["prompt"]["chunks"] for t in chunk["tokens"])
    return target, prompt, json.dumps(params, sort_keys=True)


class SampleRuns:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._run: list[Pending] = []

    def barrier(self) -> None:
        """A request of another kind was queued: later samples start a new run."""
        with self._lock:
            self._run = []

    def add(self, body: dict, key: tuple | None) -> Pending:
        with self._lock:
            pending = Pending(body, key, self._run)
            self._run.append(pending)
            return pending

    def take(self, pending: Pending) -> list[Pending]:
        """``pending`` and the waiting requests of its run it can be drawn with, marked
        taken and dropped from the run (which a client that only samples never ends);
        [] when an earlier job took ``pending`` already."""
        with self._lock:
            if pending.taken:
                return []
            group = [pending] + [p for p in pending.run if p is not pending
                                 and pending.key is not None and p.key == pending.key]
            for p in group:
                p.taken = True
            pending.run[:] = [p for p in pending.run if not p.taken]
            return group
