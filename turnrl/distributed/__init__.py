"""Distributed rollouts on Ray: rollout worker actors, the fleet that drives them, the books.

``RaySource`` (source.py) is a rollout source of the one learner loop
(``turnrl.trainer.learn``) over ``RolloutWorker`` actors (workers.py), driven through a
``Fleet`` (fleet.py) with an ``AssignmentBook`` (book.py). ``turnrl.launch`` picks it for
``run.mode: async``. Importing this package needs Ray only when workers are started
(``pip install 'turnrl[ray]'``).
"""

from turnrl.distributed.book import AssignmentBook
from turnrl.distributed.ledger import LEDGER_FILE
from turnrl.distributed.source import AsyncTrainResult, RaySource
from turnrl.distributed.workers import RolloutWorker, WorkerReport, spawn_workers

__all__ = ["LEDGER_FILE", "AssignmentBook", "AsyncTrainResult", "RaySource", "RolloutWorker",
           "WorkerReport", "spawn_workers"]
