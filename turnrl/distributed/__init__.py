"""Distributed rollouts on Ray: rollout worker actors, the fleet that drives them, the books.

``RaySource`` (source.py) is the async learner's rollout source over ``RolloutWorker``
actors (workers.py), driven through a ``Fleet`` (fleet.py) with an ``AssignmentBook``
(book.py). Trainer-free: ``turnrl.launch`` joins it to the learner loop. Importing this
package needs Ray only when workers are started (``pip install 'turnrl[ray]'``).
"""

from turnrl.distributed.book import AssignmentBook, split_stale
from turnrl.distributed.source import LEDGER_FILE, RaySource
from turnrl.distributed.workers import RolloutWorker, WorkerReport, spawn_workers

__all__ = ["LEDGER_FILE", "AssignmentBook", "RaySource", "RolloutWorker", "WorkerReport",
           "spawn_workers", "split_stale"]
