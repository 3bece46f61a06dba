"""Guidance for groups that all fail (``explore.guidance``): give GRPO a signal where it has none.

When no episode of a group succeeds and their rewards are all equal, every advantage in the
group is zero and the step learns nothing from it: the usual state of a model that cannot do
its task yet. Two remedies, both using the env's reference player (``reference_player()``
or a built-in one, envs/reference.py):

- ``demo``: the player plays the group's seed, and its successful episode joins the group as
  if the policy had written it (the turn loop's token layout, ``sft/conversation.py``). GRPO
  then pushes the group's failures down and the demonstration up. After LUFFY (Yan et al.
  2025, "Learning to Reason under Off-Policy Guidance", arXiv:2504.14945), which mixes
  off-policy demonstrations into GRPO groups.
- ``hint``: the group's seed is played ``guidance_attempts`` more times by the policy, with
  the player's first reply given as a hint after the first observation. After GHPO (Liu et
  al. 2025, "Adaptive Guidance for Hybrid Policy Optimization", arXiv:2507.10628), which adds
  part of the reference solution to the prompt of problems the model fails.

The off-policy correction (``demo``): a demonstration's tokens were not sampled by the policy,
so there is no behaviour log-probability. LUFFY takes it as 1, so its ratio is ``pi_theta``
itself (and it adds policy shaping ``f(p) = p / (p + 0.1)`` to lift rare tokens). Here the
"old" log-probs of a demonstration are the learner's own before the update
(``learner_logprobs``), so its PPO ratio starts at 1 and the gradient is ``A * grad log pi``:
for a positive advantage, the supervised gradient scaled by the advantage, strongest on the
tokens the policy finds least likely (what LUFFY's shaping aims at). The ratio then clips
as any other token's would. Such tokens also read as no mismatch (docs/mismatch.md).

Departures: LUFFY replaces rollouts with demonstrations and GHPO decides per problem how much
of the solution to show; here guidance is added (the group grows by one demonstration or by
``guidance_attempts`` hinted episodes), and the hint is the player's whole first reply
(for a single-turn task, the answer itself). Hinted episodes keep their hinted prompt: they
are on-policy given that prompt, and train the policy under it, as in GHPO. Evaluation never
sees guidance. Each step logs ``guide/fired_groups``, ``guide/episodes`` and ``guide/success``;
the step's ``reward/mean`` and ``success/rate`` leave guided episodes out (the policy's own).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from turnrl.demos.conversation import DemoError, conversation_episode
from turnrl.demos.scripted import scripted_conversation
from turnrl.envs.reference import reference_player
from turnrl.rollout import run_sync
from turnrl.trainer.rl_step import explore_settings
from turnrl.trainer.step import batch_logprobs
from turnrl.types import Batch, Episode


def failed_groups(episodes: Sequence[Episode]) -> list[tuple[int, int]]:
    """(group, seed) of each group in which no episode succeeded and every reward is equal:
    the groups whose advantages are all zero."""
    groups: dict[int, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault(ep.group, []).append(ep)
    return [(group, eps[0].seed) for group, eps in groups.items()
            if not any(ep.success for ep in eps) and len({ep.reward for ep in eps}) == 1]


class HintedEnv:
    """``env`` with ``hint`` appended to its first observation; everything else delegated."""

    def __init__(self, env: Any, hint: str) -> None:
        self._env, self._hint = env, hint

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    async def reset(self, seed: int) -> str:
        return f"{await self._env.reset(seed)}\n\n{self._hint}"

    async def step(self, action: str):
        return await self._env.step(action)


async def first_reply(env: Any, env_name: str, seed: int) -> str | None:
    """The reference player's first reply on ``seed`` (None: the env has no player)."""
    observation = await env.reset(seed)
    player = reference_player(env, env_name)
    if player is None:
        return None
    player.reset(observation)
    return player.act(observation)


def hint_text(reply: str) -> str:
    return f"Hint: a good first reply here is: {reply}"


def learner_logprobs(model: torch.nn.Module, episodes: list[Episode], pad_id: int,
                     temperature: float) -> None:
    """Set each episode's policy-token log-probs to the model's own (in place): the "old"
    policy of a demonstration the policy did not sample (see the module docstring)."""
    if not episodes:
        return
    was_training = model.training
    model.eval()
    batch = Batch.from_episodes(episodes, torch.zeros(len(episodes)), pad_id)
    scores = batch_logprobs(model, batch, temperature, len(episodes))
    model.train(was_training)
    for row, ep in enumerate(episodes):
        for index, trained in enumerate(ep.loss_mask):
            if trained:
                ep.logprobs[index] = float(scores[row, index])


class Guidance:
    """Adds guided episodes to a step's all-failed groups (``LocalSource`` calls ``apply``)."""

    def __init__(self, mode: str, attempts: int) -> None:
        self.mode, self.attempts = mode, attempts
        self.warned = False

    def apply(self, episodes: list[Episode], run: Any, play: Callable[..., list[Episode]]
              ) -> tuple[list[Episode], dict[str, float]]:
        """``episodes`` plus the guided ones, and the step's ``guide/*`` metrics. ``play(seeds,
        make)`` plays ``(seed, group)`` pairs with the policy on envs from ``make``."""
        cfg, policy = run.cfg, run.policy
        targets = failed_groups(episodes)
        guided: list[Episode] = []
        for group, seed in targets:
            if self.mode == "demo":
                guided += self._demo(cfg, run, seed, group)
            else:
                guided += self._hinted(cfg, policy, seed, group, play)
        if targets and not guided:
            self._warn(cfg.env.name)
        for ep in guided:
            ep.info["guided"] = self.mode
        fired = len({ep.group for ep in guided})
        metrics = {"guide/fired_groups": float(fired), "guide/episodes": float(len(guided)),
                   "guide/success": (sum(ep.success for ep in guided) / len(guided)
                                     if guided else 0.0)}
        return episodes + guided, metrics

    def _demo(self, cfg: Any, run: Any, seed: int, group: int) -> list[Episode]:
        policy = run.policy
        env = policy.make_env()
        try:
            messages, tools, success, reward = run_sync(scripted_conversation(
                env, cfg.env.name, seed, policy.chat, cfg.rollout.max_turns))
        except Exception as err:  # noqa: BLE001 - no player (DataError) or a player that breaks
            self._warn(cfg.env.name, f"{type(err).__name__}: {err}")
            return []
        if not success:
            return []
        try:
            ep = conversation_episode(policy.chat, messages, tools, env=cfg.env.name, seed=seed)
        except DemoError as err:
            self._warn(cfg.env.name, f"the template cannot render its demonstration: {err}")
            return []
        longest = max(turn.end - turn.start for turn in ep.turns)
        if longest > cfg.rollout.max_new_tokens + 1:  # + the end-of-turn token
            self._warn(cfg.env.name, f"a demonstrated reply has {longest - 1} tokens, more than "
                       f"rollout.max_new_tokens {cfg.rollout.max_new_tokens} lets the policy "
                       "write; raise it")
            return []
        ep.group, ep.reward, ep.success = group, reward, True
        ep.end("done", "done")
        # at the update's temperature (a temperature schedule moves it), so the ratio is 1
        learner_logprobs(policy.model, [ep], policy.tokenizer.pad_token_id,
                         explore_settings(run.learner).temperature)
        return [ep]

    def _hinted(self, cfg: Any, policy: Any, seed: int, group: int,
                play: Callable[..., list[Episode]]) -> list[Episode]:
        reply = run_sync(first_reply(policy.make_env(), cfg.env.name, seed))
        if reply is None:
            return []
        hint = hint_text(reply)
        return play([(seed, group)] * self.attempts,
                    lambda: HintedEnv(policy.make_env(), hint))

    def _warn(self, env_name: str, why: str = "") -> None:
        if not self.warned:
            self.warned = True
            detail = why or "it has no reference player (reference_player(), envs/reference.py)"
            warnings.warn(f"explore.guidance: env '{env_name}' cannot be guided ({detail}); "
                          "its all-failed groups train unguided", stacklevel=3)
