"""Tree rollouts (``rollout.branch``): an episode forks at a turn boundary into ``k``
continuations that share its tokens so far (Tree-GRPO: Ji et al. 2025, arXiv:2509.21240).

When an episode has played a fork turn (``BranchPlan.turns``) and the env has answered, the
turn loop (loop.py) gives it ``k - 1`` siblings. Each sibling is a copy of the episode so far,
its own tokens identical, with one difference: its loss mask is 0 on the shared tokens, which
the original (continuation 0) keeps, so the prefix is trained once (algorithms/tree.py says
what advantage it gets). ``info["branch"]`` records the tree: ``root`` (the episode it grew
from, numbered within its turn loop), ``tree`` (an id unique across loops: a failed group's
hinted replays, trainer/guidance.py, play the group's seed again in a second loop whose roots
are numbered from 0 as well) and ``path`` (its forks, ``[turn, child]`` each, root first).

A sibling needs an env in the same state. Envs are deterministic under ``reset(seed)``
(the Env protocol), so a fresh env from the same factory is reset with the seed and stepped
through the episode's actions; every observation and reward must come back as recorded, or
the run stops with ``NotReplayable`` (an env with hidden randomness, a clock, a live
service), since siblings of another state would be compared as if they shared one.

Sampling shares the prefix without anything here: the siblings' next prompts are equal, and
the HF sampler prefills equal prompts of one call once, continuing the KV cache the original
kept for its own tokens (samplers/hf.py). In the update all ``k`` rows share it through the
shared-prefix pass (trainer/prefix.py): the siblings' rows cut where their own tokens begin,
and the original's row, whose shared turns are trained, joins their prefix and has those
turns scored from the prefix's one pass.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import Callable
from dataclasses import replace

from turnrl.config.branch import BranchPlan
from turnrl.envs import contract
from turnrl.rollout.env_calls import EnvThreads, checked_observation, checked_step, fail_episode
from turnrl.rollout.loop_stats import LoopStats
from turnrl.rollout.slots import BRANCH, POLICY, GroupState
from turnrl.rollout.slots import Slot as _Slot
from turnrl.types import Episode


class NotReplayable(ValueError):
    """An env that did not replay its episode from seed and actions (or has seats): tree
    rollouts refuse it; a ``ValueError``, so ``turnrl train`` says so in one line."""


def branch_episode(trunk: Episode, turn: int, child: int) -> Episode:
    """A copy of ``trunk`` (forked after ``turn``) as continuation ``child``: the same tokens
    and facts, its loss mask 0 on all of them (the trunk trains them)."""
    info = copy.deepcopy(trunk.info)
    info["branch"]["path"][-1] = [turn, child]
    return Episode(env=trunk.env, seed=trunk.seed, group=trunk.group,
                   token_ids=list(trunk.token_ids), loss_mask=[0] * len(trunk.loss_mask),
                   logprobs=list(trunk.logprobs), versions=list(trunk.versions),
                   turns=[replace(t) for t in trunk.turns], reward=trunk.reward,
                   success=trunk.success, info=info)


class Forks:
    """The turn loop's collaborator for ``rollout.branch``: which slots fork, their siblings'
    replays, and what a replay's end does to its sibling."""

    def __init__(self, plan: BranchPlan, threads: EnvThreads, env_name: str,
                 env_timeout_s: float, make: Callable) -> None:
        self.plan, self.threads, self.make = plan, threads, make
        self.env_name, self.env_timeout_s = env_name, env_timeout_s
        self.forked = 0
        """Siblings started so far."""

    def due(self, slot: _Slot) -> bool:
        """``slot`` has just been answered on a fork turn and has not forked there yet."""
        played = len(slot.episode.turns)
        if slot.phase != POLICY or played not in self.plan.turns:
            return False
        path = (slot.episode.info.get("branch") or {}).get("path") or [[0, 0]]
        return path[-1][0] < played

    def fork(self, slot: _Slot, group: GroupState, stats: LoopStats) -> list[_Slot]:
        """``k - 1`` siblings of ``slot``, their replays launched, counted in its ``group``
        (which now ends when they have ended too); ``slot`` becomes child 0. Called on the
        loop's thread, the only one that touches a group's state."""
        if slot.game is not None:
            raise NotReplayable(f"env '{self.env_name}' has seats: rollout.branch forks "
                                "single-agent episodes only")
        turn, episode, make = len(slot.episode.turns), slot.episode, slot.make or self.make
        tree = episode.info.setdefault("branch", {"root": slot.assignment,
                                                  "tree": uuid.uuid4().hex, "path": []})
        tree["path"].append([turn, 0])
        siblings = []
        for child in range(1, self.plan.k):
            env = contract.chosen_for_seed(make(), episode.seed)
            sibling = _Slot(branch_episode(episode, turn, child), slot.assignment, env,
                            self.threads.runner(env), phase=BRANCH,
                            messages=copy.deepcopy(slot.messages), rendered=slot.rendered,
                            tools=slot.tools, state=slot.state, temperature=slot.temperature,
                            first=slot.first, make=make)
            sibling.task = asyncio.ensure_future(self._replay(sibling))
            siblings.append(sibling)
        self.forked += len(siblings)
        group.episodes += [s.episode for s in siblings]
        group.open += len(siblings)
        stats.episodes_started += len(siblings)
        return siblings

    async def _replay(self, slot: _Slot) -> None:
        """Reset ``slot``'s env with the seed and step it through the recorded actions,
        checking every observation and reward against the record."""
        episode, timeout = slot.episode, self.env_timeout_s
        first = checked_observation(await slot.runner.call("reset", episode.seed, timeout),
                                    self.env_name)
        self._same(first == slot.first, episode, "its first observation")
        for number, turn in enumerate(episode.turns, 1):
            result = checked_step(await slot.runner.call("step", turn.action, timeout),
                                  self.env_name)
            same = (result.observation == turn.observation and float(result.reward) == turn.reward
                    and not result.done)
            self._same(same, episode, f"turn {number}'s observation, reward or end")

    def _same(self, same: bool, episode: Episode, what: str) -> None:
        if not same:
            raise NotReplayable(
                f"env '{self.env_name}' replayed seed {episode.seed} with the same actions "
                f"and changed {what}: rollout.branch re-creates an episode's env by replaying "
                "it, so the env must be deterministic given its seed and actions; drop "
                "rollout.branch for this env")

    def after_replay(self, slot: _Slot, error: BaseException | None) -> None:
        """The sibling waits for the policy, or fails as an env call fails; an env that
        replayed differently stops the run."""
        if isinstance(error, NotReplayable):
            raise error
        if error is not None:
            return fail_episode(slot.episode, error, "branch replay")
        slot.phase = POLICY
