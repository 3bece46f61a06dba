"""The opponent pool: frozen past copies of the policy, one drawn for each game
(``opponent: pool``, docs/selfplay.md).

The pool's rule: a frozen copy of the policy's weights is taken at the start (version 0)
and then after every ``env.opponent_pool_every``-th update; the newest
``env.opponent_pool_size`` are kept, in memory; the ``n``-th game's opponent is drawn
uniformly from them, and samples its moves, on a random stream of its own seeded by
(``run.seed``, ``n``): what a game plays depends on neither the order env threads reach the
model nor on the games before it. The pool is saved with each checkpoint (its versions'
weights and the number of games drawn: ``state_dict``, ``frozen_weights``), so a resumed run
plays the same opponents as an uninterrupted one. An async run saves the same pool from the
learner's side (turnrl/distributed/pool_state.py): the same versions and weights on resume,
but not the same game-by-game draws (which worker plays which game depends on timing).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence

import torch

from turnrl.envs import Env
from turnrl.rollout import ChatFormat
from turnrl.samplers import SamplingParams
from turnrl.selfplay.opponents import FrozenPolicy, PoolPlayer, attach_player

POOL_DIR = "opponent_pool"
"""Where a checkpoint holds the pool's members (``opponent_pool/v000004``)."""


def member_name(version: int) -> str:
    """The checkpoint subdirectory of the pool member ``version`` (turnrl/checkpoint.py)."""
    return f"{POOL_DIR}/v{version:06d}"


class OpponentPool:
    """Frozen copies of the policy (see the module docstring for the rule)."""

    def __init__(self, chat: ChatFormat, params: SamplingParams, *, size: int, every: int,
                 seed: int = 0) -> None:
        if size < 1 or every < 1:
            raise ValueError(f"opponent pool size and every must be >= 1, got {size}, {every}")
        self.chat, self.params, self.size, self.every = chat, params, size, every
        self.seed, self.draws = seed, 0
        self.members: list[FrozenPolicy] = []
        self.changed = threading.Condition()
        """Notified when the members change (an async worker's games wait for the first)."""
        self.closed = False

    def offer(self, version: int, model: torch.nn.Module) -> bool:
        """Keep a frozen copy of ``model`` as ``version`` when the rule says so (the first
        offered, then every ``every``-th version); the oldest goes past ``size``."""
        kept = pool_after_offer(self.versions(), version, self.every, self.size)
        if kept is None:
            return False
        self._keep(FrozenPolicy(model, self.chat, self.params, version, self.seed))
        return True

    def _keep(self, member: FrozenPolicy) -> None:
        self.members.append(member)
        del self.members[:-self.size]

    def hold(self, versions: Sequence[int], build: Callable[[int], FrozenPolicy]) -> None:
        """Keep exactly ``versions``, the learner's pool (an async worker's mirror of it): a
        version not held yet is ``build(version)``, one no longer named is dropped."""
        held = {m.version: m for m in self.members}
        members = [held.get(v) or build(v) for v in versions]
        with self.changed:
            self.members = members
            self.changed.notify_all()

    def close(self) -> None:
        """Games waiting for a first member stop waiting (``sample`` raises)."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def sample(self, wait_s: float = 0.0) -> PoolPlayer:
        """The next game's opponent: a member drawn uniformly, with a sampling stream of its
        own, both from the stream seeded by (seed, number of games drawn so far); waits up to
        ``wait_s`` for a first member (async workers: the learner's pool arrives with its
        weights)."""
        with self.changed:
            self.changed.wait_for(lambda: self.members or self.closed, timeout=wait_s)
            if not self.members:
                raise RuntimeError("the opponent pool is empty: offer the policy first")
            draw = random.Random(f"opponent-pool/{self.seed}/{self.draws}")
            self.draws += 1
            return PoolPlayer(draw.choice(self.members), draw.getrandbits(63))

    def versions(self) -> list[int]:
        return [m.version for m in self.members]

    def attach(self, make: Callable[[], Env]) -> Callable[[], Env]:
        """``make`` with each new env's opponent drawn from the pool (``set_opponent``)."""
        return attach_player(make, self.sample)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """What a resume needs besides the members' weights (``frozen_weights``)."""
        return {"versions": self.versions(), "draws": self.draws}

    def frozen_weights(self) -> dict[str, torch.nn.Module]:
        """Each member's frozen model by its checkpoint name (``member_name``)."""
        return {member_name(m.version): m.model for m in self.members}

    def load_state_dict(self, state: dict, model: torch.nn.Module,
                        load: Callable[[str, torch.nn.Module], bool]) -> None:
        """The saved pool back: each version a copy of ``model`` (the policy, for its
        architecture) with the weights ``load(name, copy)`` puts in; ``ValueError`` naming the
        version if a checkpoint lacks one."""
        members = []
        for version in state["versions"]:
            member = FrozenPolicy(model, self.chat, self.params, int(version), self.seed)
            if not load(member_name(int(version)), member.model):
                raise ValueError(f"opponent pool version {version} has no weights under "
                                 f"{member_name(int(version))}/")
            members.append(member)
        self.members = []
        for member in members:
            self._keep(member)
        self.draws = int(state["draws"])


def pool_wait_s(env_timeout_s: float) -> float:
    """How long a game waits for an async worker's pool (``PoolDraw``): it waits inside an env
    call (the reset or step that first needs the opponent) timed by ``rollout.env_timeout_s``
    from before it starts, so it must give up first for the game to fail with the pool's
    reason rather than as an env timeout (with equal waits the two raced). The call keeps a
    margin of a fifth of its time, at least 1 s but at most half of it: a 30 s call waits
    24 s, a 4 s one 3 s, a 1 s one 0.5 s."""
    return max(0.5 * env_timeout_s, min(0.8 * env_timeout_s, env_timeout_s - 1.0))


class PoolDraw:
    """One game's pool opponent, drawn when the game first needs it (its ``name`` or a move),
    on the env's thread: an async worker's pool may still be waiting for the learner's first
    version, and the turn loop must not wait for it (nor hold its lock) while starting games.
    A pool still empty after ``wait_s`` fails that game only, with the pool's reason (an async
    worker waits ``pool_wait_s(rollout.env_timeout_s)``)."""

    def __init__(self, pool: OpponentPool, wait_s: float) -> None:
        self.pool, self.wait_s = pool, wait_s
        self.player: PoolPlayer | None = None

    def drawn(self) -> PoolPlayer:
        if self.player is None:
            self.player = self.pool.sample(self.wait_s)
        return self.player

    @property
    def name(self) -> str:
        return self.drawn().name

    def act(self, system_prompt: str | None, observation: str) -> str:
        return self.drawn().act(system_prompt, observation)


def pool_after_offer(kept: Sequence[int], version: int, every: int, size: int
                     ) -> list[int] | None:
    """The pool's versions once ``version`` is offered (the first offered joins, then every
    ``every``-th version; the newest ``size`` are kept), or None when it does not join."""
    if kept and version % every or version in kept:
        return None
    return [*kept, version][-size:]
