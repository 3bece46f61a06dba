"""Success replay (``explore.success_replay_age``): a task's past success joins a later group
of that task in which nothing succeeded.

A group whose episodes all fail with equal rewards has zero advantages: GRPO learns nothing
from it, however close the policy came earlier. ARPO (Lu et al. 2025, "ARPO: End-to-End Policy
Optimization for GUI Agents with Experience Replay", arXiv:2505.16282) keeps successful
trajectories per task and puts one into such a group; SPEAR (Qin et al. 2025, "Learn the
Ropes, Then Trust the Wins: Self-imitation with Progressive Exploration for Agentic RL") replays
the agent's own good trajectories in the same spirit. Here each task keeps its latest successful
episode (the best-rewarded of its group) for ``success_replay_age`` steps; a later all-failed
group of the task gets a copy added, so the group's failures are pushed down and the old
success up.

The copy keeps the log-probabilities of the policy that sampled it, so it is off-policy data:
the update then uses decoupled PPO (``algo.decoupled``, AReaL), whose per-token weight
``pi_proximal / pi_behaviour`` (truncated at ``algo.is_cap``) corrects for the older sampler,
and the age bound keeps that weight from drifting far.

A task is what the policy is asked: the prompt tokens before its first reply (``task_key``), so
seeds with the same prompt are one task. An env whose hidden state is not in the prompt (a
secret number) has one task for all its seeds: a replayed success there was earned against
another hidden state. Departures: ARPO replaces a failed rollout; here the success is added
(the group grows by one, like ``explore.guidance``). Replayed episodes carry
``info["guided"] = "replay"``, so the step's ``reward/mean`` and ``success/rate`` are the
policy's own.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence

from turnrl.types import Episode


def task_key(episode: Episode) -> str:
    """The task as the policy sees it: a digest of the prompt tokens before its first reply."""
    first = next((i for i, m in enumerate(episode.loss_mask) if m), len(episode.token_ids))
    return hashlib.blake2b(str(episode.token_ids[:first]).encode(), digest_size=12).hexdigest()


def failed_groups(episodes: Sequence[Episode]) -> list[tuple[int, int]]:
    """(group, seed) of each group in which no episode succeeded and every reward is equal:
    the groups whose advantages are all zero."""
    groups: dict[int, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault(ep.group, []).append(ep)
    return [(group, eps[0].seed) for group, eps in groups.items()
            if not any(ep.success for ep in eps) and len({ep.reward for ep in eps}) == 1]


def best_successes(episodes: Sequence[Episode]) -> dict[int, Episode]:
    """Each group's best-rewarded successful episode (groups without one left out)."""
    best: dict[int, Episode] = {}
    for ep in episodes:
        if ep.success and (ep.group not in best or ep.reward > best[ep.group].reward):
            best[ep.group] = ep
    return best


class SuccessReplay:
    """The latest success of each task, kept ``max_age`` steps (the module docstring)."""

    MAX_TASKS = 10_000  # a run over endless fresh tasks holds bounded memory

    def __init__(self, max_age: int) -> None:
        self.max_age = max_age
        self.step = 0
        self.kept: dict[str, tuple[int, Episode]] = {}  # task -> (step stored, a copy)

    def mix(self, episodes: list[Episode]) -> tuple[list[Episode], dict[str, float]]:
        """``episodes`` plus a replayed success for each all-failed group whose task has one,
        and the step's ``replay/*`` metrics; then this step's successes are kept."""
        self.step += 1
        self.kept = {key: (at, ep) for key, (at, ep) in self.kept.items()
                     if self.step - at <= self.max_age}
        firsts: dict[int, Episode] = {}
        for ep in episodes:
            firsts.setdefault(ep.group, ep)
        replayed, ages = [], []
        for group, _ in failed_groups(episodes):
            kept = self.kept.get(task_key(firsts[group]))
            if kept is None:
                continue
            at, success = kept
            again = copy.deepcopy(success)
            again.group, again.env = group, firsts[group].env  # joins the group as its own
            again.info.update(guided="replay", replay_age=self.step - at)
            replayed.append(again)
            ages.append(self.step - at)
        for ep in best_successes(episodes).values():
            key = task_key(ep)
            self.kept.pop(key, None)  # re-inserted last: the newest
            self.kept[key] = (self.step, copy.deepcopy(ep))
        while len(self.kept) > self.MAX_TASKS:
            del self.kept[next(iter(self.kept))]
        return episodes + replayed, {
            "replay/groups": float(len(replayed)), "replay/kept_tasks": float(len(self.kept)),
            "replay/age_mean": sum(ages) / len(ages) if ages else 0.0}

    def state_dict(self) -> dict:
        return {"step": self.step, "kept": self.kept}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.kept = state.get("step", 0), dict(state.get("kept", {}))
