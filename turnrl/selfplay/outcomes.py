"""What games say, per role: win/draw/loss rates with their intervals, for evaluation and
for a training step's metrics (docs/selfplay.md, "Evaluation")."""

from __future__ import annotations

from collections.abc import Sequence

from turnrl.stats import wilson_interval
from turnrl.types import Episode

OUTCOMES = ("win", "draw", "loss")
"""Rates a role's table gives; an illegal move counts as a loss, an episode that did not
finish (``failed``: env error, timeout, turn limit) as none of them."""


def role_outcomes(episodes: Sequence[Episode]) -> dict[str, dict[str, float]]:
    """Win/draw/loss counts, rates and 95% Wilson intervals per role, over the episodes that
    name a ``role`` (``info``): role -> {episodes, win, win_lo, win_hi, draw, ..., loss, ...,
    failed, reward}. An ``illegal`` outcome is a loss; an episode without an outcome (it
    failed or was cut off) is ``failed`` and counts in the denominator of every rate."""
    by_role: dict[str, list[Episode]] = {}
    for ep in episodes:
        if "role" in ep.info:
            by_role.setdefault(str(ep.info["role"]), []).append(ep)
    table = {}
    for role, played in sorted(by_role.items()):
        n = len(played)
        counts = {name: 0 for name in OUTCOMES}
        failed = 0
        for ep in played:
            outcome = ep.info.get("outcome") if ep.status == "done" else None
            outcome = "loss" if outcome == "illegal" else outcome
            if outcome in counts:
                counts[outcome] += 1
            else:
                failed += 1
        row: dict[str, float] = {"episodes": n, "failed": failed,
                                 "reward": sum(ep.reward for ep in played) / n}
        for name, count in counts.items():
            lo, hi = wilson_interval(count, n)
            row.update({name: count / n, f"{name}_lo": lo, f"{name}_hi": hi})
        table[role] = row
    return table


def outcome_metrics(episodes: Sequence[Episode], prefix: str = "") -> dict[str, float]:
    """``role_outcomes`` flattened to metric names, ``{prefix}{role}/{key}``, per env label
    (``Episode.env``) when the episodes come from several (an evaluation's opponents)."""
    labels = sorted({ep.env for ep in episodes})
    metrics = {}
    for label in labels:
        mine = [ep for ep in episodes if ep.env == label]
        head = f"{prefix}{label}/" if len(labels) > 1 else prefix
        for role, row in role_outcomes(mine).items():
            metrics.update({f"{head}{role}/{key}": float(v) for key, v in row.items()})
    return metrics


def game_step_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """A training step's game metrics: per role win rate and mean reward, how many episodes
    come from games that broke the zero-sum rule (``warn/zero_sum``), and how many episodes
    each opponent played."""
    if not any("role" in ep.info and "opponent" in ep.info for ep in episodes):
        return {}
    metrics = {}
    for role, row in role_outcomes(episodes).items():
        metrics[f"game/{role}/win"] = row["win"]
        metrics[f"game/{role}/reward"] = row["reward"]
    # warn/: shown on the progress bar while it is nonzero (trainer/run.py end_step)
    metrics["warn/zero_sum"] = float(sum("zero_sum_violation" in ep.info for ep in episodes))
    for ep in episodes:
        key = f"game/opponent/{ep.info.get('opponent', 'none')}"
        metrics[key] = metrics.get(key, 0.0) + 1
    return metrics
