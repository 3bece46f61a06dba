"""``rollout.branch``: the plan of tree rollouts, parsed from its dict once, with one-line errors.

``--rollout.branch.turns 1 --rollout.branch.k 2``: every episode forks after its turn 1 (once the
env has answered it) into 2 continuations that share its tokens so far (rollout/branch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from turnrl.config.types import ConfigError, did_you_mean

BRANCH_KEYS = ("turns", "k")
MAX_LEAVES = 256
"""Most leaves one episode may grow into (k ** len(turns)): a typo like k 20 with three fork
turns would otherwise ask for 8000 episodes per seed."""


@dataclass(frozen=True)
class BranchPlan:
    """Fork after each turn in ``turns`` (counted from 1) into ``k`` continuations."""

    turns: tuple[int, ...]
    k: int

    @property
    def leaves(self) -> int:
        """Episodes one root grows into when it plays past every fork turn."""
        return self.k ** len(self.turns)


def parse_branch(options: dict[str, Any], max_turns: int) -> BranchPlan | None:
    """``rollout.branch`` as a plan (None: {} , branching off); ``ConfigError`` for nonsense."""
    if not options:
        return None
    for key in options:
        if key not in BRANCH_KEYS:
            raise ConfigError(f"unknown key rollout.branch.{key}"
                              f"{did_you_mean(str(key), BRANCH_KEYS) or '; valid: turns, k'}")
    turns = options.get("turns")
    turns = [turns] if isinstance(turns, int) and not isinstance(turns, bool) else turns
    if not (isinstance(turns, list | tuple) and turns
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in turns)):
        raise ConfigError(f"rollout.branch.turns must be turn numbers >= 1 (an int or a list, "
                          f"e.g. 1 or [1, 2]: fork after those turns), got {turns!r}")
    if len(set(turns)) != len(turns):
        raise ConfigError(f"rollout.branch.turns {list(turns)} names a turn twice; name each "
                          "fork turn once")
    if max(turns) >= max_turns:
        raise ConfigError(f"rollout.branch.turns {list(turns)} forks after turn {max(turns)}, "
                          f"but rollout.max_turns {max_turns} leaves no turn after it; fork "
                          "earlier or raise rollout.max_turns")
    k = options.get("k", 2)
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise ConfigError(f"rollout.branch.k must be an int >= 2 (continuations per fork), got "
                          f"{k!r}")
    plan = BranchPlan(tuple(sorted(turns)), k)
    if plan.leaves > MAX_LEAVES:
        raise ConfigError(f"rollout.branch k {k} over {len(turns)} fork turns grows each "
                          f"episode into {plan.leaves} leaves (at most {MAX_LEAVES}); lower k or "
                          "fork at fewer turns")
    return plan
