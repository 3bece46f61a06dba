"""``async/refresh_*`` metrics: what ct2 rollout workers' background weight conversions cost
(turnrl/samplers/ct2_refresh.py), per learner step, from the running totals each worker
reports (``refresh_*`` in its stats). Pure: no Ray, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

SUMMED = ("conversions", "convert_s", "convert_cpu_s", "wait_s", "unused", "swaps")
"""Totals whose growth since the last step is logged (summed over the workers)."""
PEAKS = ("convert_max_s", "wait_max_s")
"""Largest single conversion and wait of the run so far (the largest over the workers)."""


def refresh_metrics(now: Mapping[int, Mapping[str, float]],
                    before: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
    """The step's ``async/refresh_*`` from every worker's totals ``now`` and at the last step
    (``before``); empty where no worker converts (hf, vllm). A worker whose totals went down
    was restarted: it counts from zero.

    ``async/refresh_convert_s`` is the mean wall seconds a conversion took this step (NaN
    when none finished), ``async/refresh_wait_s`` the seconds sampling waited on a refresh
    this step, all workers together (the first version's load apart: ``first_wait_s``)."""
    workers = {w: totals for w, totals in now.items() if "refresh_conversions" in totals}
    if not workers:
        return {}
    grown = {key: 0.0 for key in SUMMED}
    for w, totals in workers.items():
        last = before.get(w, {})
        restarted = totals["refresh_conversions"] < last.get("refresh_conversions", 0)
        for key in SUMMED:
            value = totals.get(f"refresh_{key}", 0.0)
            grown[key] += value if restarted else value - last.get(f"refresh_{key}", 0.0)
    conversions = grown["conversions"]
    metrics = {
        "async/refresh_conversions": conversions,
        "async/refresh_convert_s": grown["convert_s"] / conversions if conversions else math.nan,
        "async/refresh_convert_cpu_s": (grown["convert_cpu_s"] / conversions if conversions
                                        else math.nan),
        "async/refresh_wait_s": grown["wait_s"],
        "async/refresh_swaps": grown["swaps"],
        "async/refresh_unused": grown["unused"],
        "async/refresh_first_wait_s": max(t.get("refresh_first_wait_s", 0.0)
                                          for t in workers.values()),
    }
    for key in PEAKS:
        metrics[f"async/refresh_{key}"] = max(t.get(f"refresh_{key}", 0.0)
                                              for t in workers.values())
    return metrics
