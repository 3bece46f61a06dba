"""The learner's books in async mode: which group (an assignment) is where, and how it ended.

The learner hands out *assignments* (an id and the seed of one GRPO group) to rollout
workers and accepts each delivered id once, so a worker restart (which re-issues what it
held) never loses a group or trains one twice. Staleness is the buffer's business
(trainer/buffer.py). Pure bookkeeping: no Ray, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from turnrl.config import Config
from turnrl.envs.base import make_env
from turnrl.envs.contract import seats
from turnrl.rollout.loop import Group


def episodes_per_group(cfg: Config) -> int:
    """Episodes one group delivers: ``rollout.group_size`` games, each one episode per seat
    of a multi-seat game (self-play: envs/contract.py ``seats``), one otherwise. Read from one
    env built here, as the learner's start-up builds it (policy.env_factories); a mix: its
    entry with the most seats."""
    built = ([make_env(e.name, **e.options) for e in cfg.env.mix_plan()]
             or [make_env(cfg.env.name, **cfg.env.options)])
    return cfg.rollout.group_size * max(max(1, len(seats(env))) for env in built)


def in_flight_groups(cfg: Config) -> int:
    """Groups the workers play at once: ``overprovision`` times a step's need."""
    return math.ceil(cfg.pool.overprovision * cfg.rollout.groups_per_step)


@dataclass(frozen=True)
class GroupPlan:
    """What the worker must use for one group, decided by the learner when it issues it
    (distributed/plan.py): None leaves the worker's own setting."""

    temperature: float | None = None
    """The sampling temperature of the step it was issued at (``explore.temperature_schedule``)."""
    entry: int | None = None
    """The ``env.mix`` entry it plays (the learner's draw for its seed)."""
    level: int | None = None
    """The ``env.curriculum`` level it plays (the learner's level when it was issued)."""


@dataclass
class Assignment:
    id: int
    seed: int
    worker: int
    seq: int
    """Submission order of the call that sent it (see ``Fleet.seq``)."""
    reissues: int = 0
    plan: GroupPlan = field(default_factory=GroupPlan)
    """Temperature, env and level the worker plays it with (re-sent with it unchanged)."""


@dataclass
class AssignmentBook:
    """Every assignment the learner hands out: where it is and how it ended.

    An assignment is outstanding from ``issue`` until its first delivery; any later delivery
    of the same id (or one the book never issued) is a duplicate and is refused. Outcomes:
    "trained", "dropped" (too stale), "regenerated" (too stale, seed re-issued under a new
    id), "abandoned" (outstanding, or delivered and unused, when the run ended).
    """

    seed_of: Callable[[int], int]
    next_index: int = 0
    """Seed index of the next new group (regenerated groups reuse a seed instead)."""
    next_id: int = 0
    outstanding: dict[int, Assignment] = field(default_factory=dict)
    seeds: dict[int, int] = field(default_factory=dict)
    plans: dict[int, GroupPlan] = field(default_factory=dict)
    """Assignment -> its plan, kept after delivery: the learner labels and counts by it."""
    outcome: dict[int, str] = field(default_factory=dict)
    duplicates: int = 0

    plan_of: Callable[[int], GroupPlan] = lambda seed: GroupPlan()  # noqa: E731
    """Seed -> the plan of a group issued now (``GroupPlanner.plan``; default: none)."""

    def issue(self, worker: int, seq: int, seed: int | None = None) -> Assignment:
        if seed is None:
            seed = self.seed_of(self.next_index)
            self.next_index += 1
        assignment = Assignment(self.next_id, seed, worker, seq, plan=self.plan_of(seed))
        self.next_id += 1
        self.outstanding[assignment.id] = assignment
        self.seeds[assignment.id] = seed
        self.plans[assignment.id] = assignment.plan
        return assignment

    def deliver(self, group: Group) -> bool:
        """Accept a delivered group once; False for a duplicate or unknown one."""
        assignment = self.outstanding.get(group.assignment)
        if assignment is None or assignment.seed != group.seed:
            self.duplicates += 1
            return False
        del self.outstanding[group.assignment]
        return True

    def resolve(self, assignment: int, outcome: str) -> None:
        if assignment in self.outcome:
            raise RuntimeError(f"assignment {assignment} already {self.outcome[assignment]}")
        self.outcome[assignment] = outcome

    def at(self, worker: int) -> list[Assignment]:
        return [a for a in self.outstanding.values() if a.worker == worker]

    def lost(self, worker: int, known: set[int], before_seq: int) -> list[Assignment]:
        """Outstanding at ``worker``, sent before ``before_seq``, and unknown to it."""
        return [a for a in self.at(worker) if a.seq < before_seq and a.id not in known]

    def move(self, assignment: Assignment, worker: int, seq: int) -> None:
        assignment.worker, assignment.seq = worker, seq
        assignment.reissues += 1


def shared_out(book: AssignmentBook, w: int, others: list[int]) -> dict[int, list[Assignment]]:
    """Donor -> assignments (its newest first) that give worker ``w`` an even share of what
    ``w`` and ``others`` hold; no donor is left under that share."""
    held = {o: sorted(book.at(o), key=lambda a: a.seq) for o in [*others, w]}
    share = sum(map(len, held.values())) // len(held)
    moved: dict[int, list[Assignment]] = {}
    need = share - len(held[w])
    while need > 0 and others:
        donor = max(others, key=lambda o: len(held[o]))
        if len(held[donor]) <= share:
            break
        moved.setdefault(donor, []).append(held[donor].pop())
        need -= 1
    return moved
