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
    env built here, as the learner's start-up builds it (policy.env_factories)."""
    return cfg.rollout.group_size * max(1, len(seats(make_env(cfg.env.name,
                                                               **cfg.env.options))))


def in_flight_groups(cfg: Config) -> int:
    """Groups the workers play at once: ``overprovision`` times a step's need."""
    return math.ceil(cfg.pool.overprovision * cfg.rollout.groups_per_step)


@dataclass
class Assignment:
    id: int
    seed: int
    worker: int
    seq: int
    """Submission order of the call that sent it (see ``Fleet.seq``)."""
    reissues: int = 0


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
    outcome: dict[int, str] = field(default_factory=dict)
    duplicates: int = 0

    def issue(self, worker: int, seq: int, seed: int | None = None) -> Assignment:
        if seed is None:
            seed = self.seed_of(self.next_index)
            self.next_index += 1
        assignment = Assignment(self.next_id, seed, worker, seq)
        self.next_id += 1
        self.outstanding[assignment.id] = assignment
        self.seeds[assignment.id] = seed
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
