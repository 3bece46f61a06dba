"""Distributed rollouts on Ray: rollout worker actors for the asynchronous trainer.

Importing this package needs Ray only when workers are started (``pip install 'turnrl[ray]'``).
"""

from turnrl.distributed.workers import RolloutWorker, WorkerReport, spawn_workers

__all__ = ["RolloutWorker", "WorkerReport", "spawn_workers"]
