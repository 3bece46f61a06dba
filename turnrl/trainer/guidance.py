"""Guidance for groups that all fail (``explore.guidance``): give GRPO a signal where it has none.

When no episode of a group succeeds and their rewards are all equal, every advantage in the
group is zero and the step learns nothing from it: the usual state of a model that cannot do
its task yet. Two remedies, both using the env's reference player (``reference_player()``
or a built-in one, envs/reference.py):

- ``demo``: the player plays the group's seed *through the turn loop* (``PlayerEngine``: an
  engine whose "samples" are the player's replies), and its successful episode joins the
  group as if the policy had written it: the loop's own tokens, loss mask, per-turn rewards,
  state keys and end reason, so turn-level estimators (GiGPO, turn-level GAE, the critic)
  credit its turns as they would the policy's. GRPO then pushes the group's failures down
  and the demonstration up. After LUFFY (Yan et al. 2025, "Learning to Reason under
  Off-Policy Guidance", arXiv:2504.14945), which mixes off-policy demonstrations into GRPO
  groups.
- ``hint``: the group's seed is played ``guidance_attempts`` more times by the policy, with
  a hint after the first observation: the env's own ``hint(level)`` (envs/contract.py), else
  a share of the player's first reply that grows with the level (``derived_hint``). After
  GHPO (Liu et al. 2025, "Adaptive Guidance for Hybrid Policy Optimization",
  arXiv:2507.10628), which adds part of the reference solution to the prompt of problems the
  model fails, more of it the harder the problem proves.

Hint levels (``HintLevels``) are a staircase per task: a task is what the policy is asked
(its prompt tokens, ``task_key``: seeds with the same prompt are one task). It starts at
level 1 (the least help); after its hinted attempts all fail it gets one level more next
time, up to ``explore.hint_levels``; after they succeed, or after a group of the policy's own
succeeds unhinted, one level less, down to 1 (``next_hint_level``). So help settles at about
the least that still lets the policy succeed.

The off-policy correction (``demo``): a demonstration's tokens were not sampled by the policy,
so there is no behaviour log-probability. LUFFY takes it as 1, so its ratio is ``pi_theta``
itself (and it adds policy shaping ``f(p) = p / (p + 0.1)`` to lift rare tokens). Here the
"old" log-probs of a demonstration are the learner's own before the update
(``learner_logprobs``), so its PPO ratio starts at 1 and the gradient is ``A * grad log pi``:
for a positive advantage, the supervised gradient scaled by the advantage, strongest on the
tokens the policy finds least likely (what LUFFY's shaping aims at). The ratio then clips
as any other token's would. Such tokens also read as no mismatch (docs/mismatch.md).

Departures: LUFFY replaces rollouts with demonstrations; here guidance is added (the group
grows by one demonstration or by ``guidance_attempts`` hinted episodes). GHPO's multi-stage
guidance gives a problem that keeps failing a growing share of its reference solution; here
that is a staircase per task, one level per appearance, which also steps back down after a
success, and a derived hint is a share of the player's first reply only (for a single-turn
task, of the answer). Hinted episodes keep their hinted prompt: they are on-policy given that
prompt, and train the policy under it, as in GHPO. Evaluation never
sees guidance. Each step logs ``guide/fired_groups``, ``guide/episodes`` and ``guide/success``
(and, for ``hint``, ``guide/hint_level``: the mean level of the groups it hinted);
the step's ``reward/mean`` and ``success/rate`` leave guided episodes out (the policy's own).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from turnrl.algorithms.replay import failed_groups, task_key
from turnrl.demos.scripted import (
    Delegating,
    PlayerEngine,
    ScriptedEnv,
    has_reference_player,
    maybe_await,
    player_for,
)
from turnrl.envs.contract import hint as env_hint
from turnrl.envs.reference import player_reply
from turnrl.rollout import run_episodes, run_sync
from turnrl.trainer.rl_step import explore_settings
from turnrl.trainer.step import batch_logprobs, update_autocast
from turnrl.types import Batch, Episode


class HintedEnv(Delegating):
    """``env`` with ``hint`` appended to its first observation."""

    def __init__(self, env: Any, hint: str) -> None:
        super().__init__(env)
        self._hint = hint

    async def reset(self, seed: int) -> str:
        return f"{await maybe_await(self._env.reset(seed))}\n\n{self._hint}"


def next_hint_level(level: int, solved: bool, levels: int) -> int:
    """The staircase (module docstring): one level more help after a task's group failed,
    one less after it succeeded, within 1..``levels``."""
    return max(1, min(levels, level - 1 if solved else level + 1))


class HintLevels:
    """Each task's hint level (``next_hint_level``); the ``MAX_TASKS`` tasks seen last kept,
    so a run over endless fresh seeds holds bounded memory."""

    MAX_TASKS = 10_000

    def __init__(self, levels: int, state: dict[str, int] | None = None) -> None:
        self.levels = levels
        self.level_of = {key: min(level, levels) for key, level in (state or {}).items()}

    def level(self, key: str) -> int:
        return self.level_of.get(key, 1)

    def record(self, key: str, solved: bool) -> None:
        level = next_hint_level(self.level(key), solved, self.levels)
        self.level_of.pop(key, None)  # re-inserted last: the newest
        self.level_of[key] = level
        while len(self.level_of) > self.MAX_TASKS:
            del self.level_of[next(iter(self.level_of))]

    def state_dict(self) -> dict[str, int]:
        return dict(self.level_of)


def derived_hint(reply: str, level: int, levels: int) -> str:
    """The hint at ``level`` of ``levels`` made from the player's first reply: its first
    ``level / levels`` share of characters (rounded up), the whole reply at the top level."""
    if level >= levels:
        return f"Hint: a good first reply here is: {reply}"
    shown = reply[:math.ceil(len(reply) * level / levels)]
    return f"Hint: a good first reply here starts with: {shown}"


async def hint_at(env: Any, env_name: str, seed: int, level: int, levels: int,
                  native_format: str | None = None) -> str | None:
    """The hint for ``seed`` at ``level``: the env's own ``hint(level)``, else one derived from
    its reference player's first reply (None: neither); tool calls in the model's own format
    (``native_format``, ``player_for``)."""
    observation = await maybe_await(env.reset(seed))
    own = env_hint(env, level)
    if own is not None:
        return own
    player = player_for(env, env_name, native_format)
    if player is None:
        return None
    player.reset(observation)
    return derived_hint(player_reply(player, observation), level, levels)


def learner_logprobs(model: torch.nn.Module, episodes: list[Episode], pad_id: int,
                     temperature: float, compute_dtype: str = "float32") -> None:
    """Set each episode's policy-token log-probs to the model's own (in place): the "old"
    policy of a demonstration the policy did not sample (see the module docstring), scored
    in the update's precision (``optim.compute_dtype``) so its ratio starts at 1."""
    if not episodes:
        return
    was_training = model.training
    model.eval()
    batch = Batch.from_episodes(episodes, torch.zeros(len(episodes)), pad_id)
    with update_autocast(model, compute_dtype):
        scores = batch_logprobs(model, batch, temperature, len(episodes))
    model.train(was_training)
    for row, ep in enumerate(episodes):
        for index, trained in enumerate(ep.loss_mask):
            if trained:
                ep.logprobs[index] = float(scores[row, index])


class Guidance:
    """Adds guided episodes to a step's all-failed groups (a source calls ``apply``).
    ``levels`` and ``state``: ``explore.hint_levels`` and the checkpoint's ``state_dict``."""

    def __init__(self, mode: str, attempts: int, levels: int = 1,
                 state: dict | None = None) -> None:
        self.mode, self.attempts = mode, attempts
        self.hint_levels = HintLevels(levels, (state or {}).get("hint_levels"))
        self.warned = False
        self.why = ""

    @classmethod
    def for_run(cls, run: Any) -> Guidance | None:
        """The run's guidance (``explore.guidance``; None when off), where a resumed run left
        its hint levels."""
        explore = run.cfg.explore
        if explore.guidance == "off":
            return None
        return cls(explore.guidance, explore.guidance_attempts, explore.hint_levels,
                   run.checkpoint_state)

    def state_dict(self) -> dict:
        """What a resume needs: each task's hint level."""
        return {"hint_levels": self.hint_levels.state_dict()} if self.mode == "hint" else {}

    def apply(self, episodes: list[Episode], run: Any, play: Callable[..., list[Episode]],
              make: Callable[[], Any] | None = None
              ) -> tuple[list[Episode], dict[str, float]]:
        """``episodes`` plus the guided ones, and the step's ``guide/*`` metrics. ``play(seeds,
        make)`` plays ``(seed, group)`` pairs with the policy on envs from ``make``; ``make``
        builds the env the step played (a curriculum's current level; default the run's)."""
        make = make or run.policy.make_env
        targets = failed_groups(episodes)
        self.why = ""  # why the step's last guided attempt came to nothing, when known
        firsts = {}  # each group's first episode: its task
        for ep in episodes:
            firsts.setdefault(ep.group, ep)
        if self.mode == "hint":
            self._record_own_successes(episodes, firsts)
        guided: list[Episode] = []
        levels_used = []
        for group, seed in targets:
            if self.mode == "demo":
                guided += self._demo(run, make, seed, group)
                continue
            key = task_key(firsts[group])
            level = self.hint_levels.level(key)
            hinted = self._hinted(run, make, seed, group, level, play)
            if hinted:
                self.hint_levels.record(key, any(ep.success for ep in hinted))
                levels_used.append(level)
                for ep in hinted:
                    ep.info["hint_level"] = level
            guided += hinted
        if targets and not guided:
            self._warn(run.cfg.env.name, self.why)
        for ep in guided:
            ep.info["guided"] = self.mode
            ep.env = firsts[ep.group].env  # a mix's label for the group's env, as its own
        fired = len({ep.group for ep in guided})
        metrics = {"guide/fired_groups": float(fired), "guide/episodes": float(len(guided)),
                   "guide/success": (sum(ep.success for ep in guided) / len(guided)
                                     if guided else 0.0)}
        if self.mode == "hint":
            metrics["guide/hint_level"] = (sum(levels_used) / len(levels_used)
                                           if levels_used else 0.0)
        return episodes + guided, metrics

    def _record_own_successes(self, episodes: list[Episode], firsts: dict[int, Episode]
                              ) -> None:
        """A task hinted before whose group now succeeds unhinted needs less help."""
        solved = {ep.group for ep in episodes if ep.success}
        for group in solved:
            key = task_key(firsts[group])
            if key in self.hint_levels.level_of:
                self.hint_levels.record(key, True)

    def _demo(self, run: Any, make: Callable[[], Any], seed: int, group: int) -> list[Episode]:
        """The reference player's episode on ``seed``, played through the turn loop; [] when
        it cannot be had or did not succeed."""
        cfg, policy = run.cfg, run.policy
        env = make()
        if not has_reference_player(env, cfg.env.name):
            return []
        scripted = ScriptedEnv(env, cfg.env.name, policy.chat.native_tools)
        # the reference player's replies, not a model's: no sampler to choose (rollout.sampler)
        engine = PlayerEngine(scripted, policy.chat, policy.engine.version)
        (ep,) = run_sync(run_episodes(
            lambda: scripted, [(seed, group)], engine, policy.chat, policy.params,
            env_name=cfg.env.name, max_turns=cfg.rollout.max_turns,
            max_context=policy.max_context, env_timeout_s=cfg.rollout.env_timeout_s))
        if engine.longest > policy.params.max_new_tokens:
            self._warn(cfg.env.name, f"a demonstrated reply has {engine.longest - 1} tokens and "
                       f"its end of turn, more than rollout.max_new_tokens "
                       f"{policy.params.max_new_tokens} lets the policy write; raise it")
            return []
        if ep.status in ("error", "timeout"):  # the env or its player broke
            self._warn(cfg.env.name, ep.info.get("reason", ep.end_reason))
            return []
        if not ep.success:
            self.why = (f"its reference player did not succeed on seed {seed} "
                        f"({ep.end_reason or ep.status})")
            return []
        # at the update's temperature (a temperature schedule moves it), so the ratio is 1
        settings = explore_settings(run.learner)
        learner_logprobs(policy.model, [ep], policy.tokenizer.pad_token_id,
                         settings.temperature, settings.optim.compute_dtype)
        return [ep]

    def _hinted(self, run: Any, make: Callable[[], Any], seed: int, group: int, level: int,
                play: Callable[..., list[Episode]]) -> list[Episode]:
        name = run.cfg.env.name
        try:
            hint = run_sync(hint_at(make(), name, seed, level, self.hint_levels.levels,
                                    run.policy.chat.native_tools))
        except Exception as err:  # noqa: BLE001 - an env's hint() or player may raise anything
            self._warn(name, f"its hint failed: {type(err).__name__}: {err}")
            return []
        if hint is None:
            return []
        return play([(seed, group)] * self.attempts, lambda: HintedEnv(make(), hint))

    def _warn(self, env_name: str, why: str = "") -> None:
        if not self.warned:
            self.warned = True
            detail = why or ("it has no reference player (reference_player(), "
                             "envs/reference.py)" + (" nor hint(level)" if self.mode == "hint"
                                                     else ""))
            warnings.warn(f"explore.guidance: env '{env_name}' cannot be guided ({detail}); "
                          "its all-failed groups train unguided", stacklevel=3)
