"""Opponents for two-seat games and what their games say, per role (docs/selfplay.md).

Opponents a game can be set to (``--env.options.opponent``): ``self`` (the policy in every
seat: one episode per seat, rollout/loop.py), ``pool`` (a frozen past policy from an
``OpponentPool``, below), ``model`` (another local model, ``ModelOpponent``), ``endpoint`` (an
agent behind an OpenAI-compatible endpoint, ``EndpointOpponent`` in envs/endpoint_opponent.py:
recorded as ``endpoint:<model>``), the game's scripted player (TicTacToe's minimax, Kuhn
Poker's Nash strategy) and ``random``. Each episode records its ``role`` and ``opponent`` in
``info``; a pool opponent is named ``pool-v<version>``, the training step its weights are
from.

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

import copy
import dataclasses
import random
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from turnrl.envs import Env, make_env
from turnrl.envs.contract import (  # noqa: F401 - uses_pool, fixed_opponent_options re-exported
    OUTSIDE_OPPONENTS,
    fixed_opponent_options,
    seats,
    uses_pool,
)
from turnrl.envs.endpoint_opponent import (  # noqa: F401 - re-exported
    EndpointError,
    EndpointOpponent,
    attach_player,
    chat_completions_url,
    reply_content,
)
from turnrl.evaluation import EvalResult
from turnrl.rollout import ChatFormat
from turnrl.rollout.batched_calls import MAX_BATCH, BatchedCalls
from turnrl.samplers import SamplingParams, chooser
from turnrl.stats import wilson_interval
from turnrl.types import Episode

"""``opponent`` values whose player the trainer hands over (``set_opponent``)."""
OUTCOMES = ("win", "draw", "loss")
"""Rates a role's table gives; an illegal move counts as a loss, an episode that did not
finish (``failed``: env error, timeout, turn limit) as none of them."""


class FrozenPolicy:
    """A past policy, frozen: ``act(system_prompt, observation)`` is its reply to a
    one-message chat (the game's whole state is in the observation). Safe to call from several env threads: the moves asked for together are
    generated in one batch (``BatchedCalls``; ``max_batch`` 1: one at a time), each on its
    game's own random stream, so a game's replies do not depend on its batch."""

    def __init__(self, model: torch.nn.Module, chat: ChatFormat, params: SamplingParams,
                 version: int, seed: int = 0, *, label: str = "",
                 max_batch: int = MAX_BATCH) -> None:
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.chat, self.params, self.version = chat, params, version
        self.label = label
        # the HF engine on its own frozen copy (a pool member must not convert per version);
        # no cache across calls: the seats' moves interleave
        self.engine = chooser.build("hf", "auto", self.model, chat.tokenizer.pad_token_id,
                                    seed=seed + version, reuse_cache=False, announce=True,
                                    who=f"opponent {self.name}")
        self.moves = BatchedCalls(self._generate, name=f"opponent {self.name}",
                                  max_batch=max_batch)

    @property
    def name(self) -> str:
        """What episodes record as their ``opponent``."""
        return self.label or f"pool-v{self.version}"

    def act(self, system_prompt: str | None, observation: str,
            generator: torch.Generator | None = None) -> str:
        """The reply, sampled on ``generator`` (a game's own stream) or the engine's own."""
        _, _, ids = self.chat.start(observation, system_prompt)
        completion = self.moves.call((ids, generator))
        tokens = completion.token_ids
        if completion.finish_reason == "stop":
            tokens = tokens[:-1]
        return self.chat.tokenizer.decode(tokens)

    def _generate(self, requests: list[tuple[list[int], torch.Generator | None]]) -> list:
        """One batch of moves: each prompt's completion, drawn on its own stream."""
        prompts, generators = zip(*requests, strict=True)
        return self.engine.generate(prompts, self.params, generators=generators)


class PoolPlayer:
    """One game's pool opponent: a member and the game's own sampling stream."""

    def __init__(self, member: FrozenPolicy, seed: int) -> None:
        self.member = member
        self.generator = torch.Generator(member.model.device).manual_seed(seed)

    @property
    def name(self) -> str:
        return self.member.name

    def act(self, system_prompt: str | None, observation: str) -> str:
        return self.member.act(system_prompt, observation, self.generator)


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


class ModelOpponent:
    """Another local model in the other seat (``opponent: model``, ``env.opponent_model``):
    one frozen player, its own tokenizer and chat template, for every game. Each game samples
    on a stream of its own (``GameStream``), seeded by (``seed``: ``run.seed``, the game's
    env seed), so what a game plays does not depend on the games beside it; the games of one
    group share their env seed and so their stream, as a scripted opponent's do."""

    def __init__(self, player: FrozenPolicy, seed: int = 0) -> None:
        self.player, self.seed = player, seed
        self.members = [player]

    @classmethod
    def load(cls, name: str, cfg: Any) -> ModelOpponent:
        """``name`` loaded as ``model.name`` would be (same dtype and cache), on the CPU."""
        from turnrl.models import load_model
        from turnrl.rollout.chat import sampling_params

        model, tokenizer = load_model(name, dtype=cfg.model.dtype,
                                      cache_dir=cfg.model.cache_dir or None,
                                      trust_remote_code=cfg.model.trust_remote_code)
        chat = ChatFormat(tokenizer)
        player = FrozenPolicy(model, chat, sampling_params(cfg, chat), 0, cfg.run.seed,
                              label=f"model:{name}")
        return cls(player, cfg.run.seed)

    def sample(self) -> GameStream:
        return GameStream(self.player, self.seed)

    def attach(self, make: Callable[[], Env]) -> Callable[[], Env]:
        """``make`` with each new env's player a ``GameStream``, seeded when the env resets."""
        def make_with_opponent() -> Env:
            env, player = make(), self.sample()
            env.set_opponent(player)
            return seeded_at_reset(env, player.start)
        return make_with_opponent


class GameStream:
    """One game of a frozen player (``opponent: model``): its moves sampled on the game's own
    stream, seeded by ``start(seed)`` from (run seed, the game's env seed)."""

    def __init__(self, member: FrozenPolicy, run_seed: int) -> None:
        self.member, self.run_seed = member, run_seed
        self.generator: torch.Generator | None = None

    @property
    def name(self) -> str:
        return self.member.name

    def start(self, seed: int) -> None:
        """A new game on env seed ``seed``: its stream starts again from that seed."""
        stream_seed = random.Random(f"opponent-model/{self.run_seed}/{seed}").getrandbits(63)
        self.generator = torch.Generator(self.member.model.device).manual_seed(stream_seed)

    def act(self, system_prompt: str | None, observation: str) -> str:
        if self.generator is None:
            raise RuntimeError(f"opponent {self.name}: a move before its game started (the "
                               "env's reset seeds the game's stream)")
        return self.member.act(system_prompt, observation, self.generator)


def seeded_at_reset(env: Env, start: Callable[[int], None]) -> Env:
    """``env`` whose ``reset(seed)`` first calls ``start(seed)`` (on the env's thread, before
    the env's own reset may ask its opponent for a move); the same object, so every other
    attribute the turn loop reads is the env's own."""
    reset = env.reset

    async def reset_and_start(seed: int) -> str:
        start(seed)
        return await reset(seed)
    env.reset = reset_and_start
    return env


# --------------------------------------------------------------------- per-role results

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


def with_outcome_metrics(result: EvalResult, episodes: Sequence[Episode]) -> EvalResult:
    """``result`` with each role's win/draw/loss rates and intervals (``outcome_metrics``,
    per opponent when evaluation played several) added to its ``env_metrics``: logged as
    ``eval/...`` and saved with the before/after results. Unchanged for episodes without
    roles."""
    table = outcome_metrics(episodes)
    if not table:
        return result
    return dataclasses.replace(result, env_metrics={**(result.env_metrics or {}), **table})


def evaluation_factories(name: str, options: dict[str, Any], env: Any
                         ) -> dict[str, Callable[[], Env]]:
    """What evaluation plays for an env trained against ``self`` or a ``pool``: the same game
    against each fixed opponent it names in ``eval_opponents``, labelled ``NAME@OPPONENT``
    (the policy's own moving copies are no fixed yardstick); any other env: itself."""
    opponents = getattr(env, "eval_opponents", ())
    if not (seats(env) or uses_pool(options)) or not opponents:
        return {name: partial(make_env, name, **options)}
    return {f"{name}@{opponent}": partial(make_env, name, **{**options, "opponent": opponent})
            for opponent in opponents}
