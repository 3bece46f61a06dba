"""One interface for every advantage estimator, outcome-level and turn-level alike.

An estimator turns a step's scored episodes into advantages for ``Batch.from_episodes``:
``[B]`` (one per episode, broadcast over its tokens) or ``[B, T]`` (per token, ``T`` = the
longest episode, zero off the policy's tokens). Estimators that learn (a critic) keep their
state between steps and hand it to checkpoints through ``state_dict``/``load_state_dict``.

Adding one: write a class with the ``AdvantageEstimator`` methods (or wrap a pure function
``(rewards [N], group_ids [N]) -> [N]`` in ``Outcome``) and register a factory
``(algo, hidden_size, seed) -> estimator`` with ``@ESTIMATORS.register("name")``. The config
then accepts ``algo.advantage: name`` (and suggests the closest name for a typo).

The maths lives elsewhere, as pure functions: ``advantages.py`` (GRPO, Dr. GRPO, RLOO,
REINFORCE++), ``credit.py`` (GiGPO, turn-level GAE, ArCHer's Q - V) and ``critic.py`` (the
turn-level critic and its updates). Scale: outcome GRPO gives unit-std advantages within a
group; GiGPO's two terms are each already normalised that way (the paper adds them unscaled).
The critic estimators' raw ``Q - V`` or GAE values carry the reward scale and the critic's
error, so they are whitened over the batch's policy tokens (PPO's usual normalisation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from turnrl.algorithms.advantages import ADVANTAGE_FNS
from turnrl.algorithms.credit import (
    anchor_fraction,
    archer_advantages,
    gigpo_advantages,
    turn_anchor_ids,
    turn_gae,
    turn_to_token_advantages,
    whiten_masked,
)
from turnrl.algorithms.critic import (
    ReplayBuffer,
    Transitions,
    TurnCritic,
    TurnFeatures,
    archer_critic_step,
    episode_transitions,
    extract_turn_features,
    value_regression_step,
)
from turnrl.config import AlgoConfig
from turnrl.registry import ESTIMATORS
from turnrl.types import Episode

CRITIC_BATCH = 256
"""Transitions per ArCHer critic step, sampled from the replay buffer."""


class AdvantageEstimator(Protocol):
    def advantages(self, episodes: Sequence[Episode], model: nn.Module, pad_id: int) -> Tensor:
        """``[B]`` or ``[B, T]`` advantages; may train the estimator's own critic."""

    def metrics(self) -> dict[str, float]:
        """What the last ``advantages`` call measured (critic losses, ...); may be empty."""

    def state_dict(self) -> dict:
        """Everything a resume needs; ``{}`` for stateless estimators."""

    def load_state_dict(self, state: dict) -> None: ...


def make_estimator(algo: AlgoConfig, hidden_size: int, seed: int = 0) -> AdvantageEstimator:
    """The estimator ``algo.advantage`` names (the config has already checked the name)."""
    ESTIMATORS.check(algo.advantage)
    return ESTIMATORS[algo.advantage](algo, hidden_size, seed)


def _abs_mean(values: Tensor) -> float:
    return float(values.abs().mean()) if values.numel() else 0.0


class Stateless:
    """Estimators with nothing to learn or save."""

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Outcome(Stateless):
    """An outcome-level estimator: one advantage per episode from its reward and group."""

    def __init__(self, fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.fn = fn

    def advantages(self, episodes: Sequence[Episode], model: nn.Module, pad_id: int) -> Tensor:
        rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float32)
        groups = torch.tensor([ep.group for ep in episodes])
        return self.fn(rewards, groups)


for _name, _fn in ADVANTAGE_FNS.items():
    ESTIMATORS[_name] = lambda algo, hidden_size, seed, fn=_fn: Outcome(fn)


def _policy_tokens(episodes: Sequence[Episode], width: int) -> Tensor:
    """``[B, width]`` bool: the tokens the policy sampled."""
    return turn_to_token_advantages(episodes, [torch.ones(len(ep.turns)) for ep in episodes],
                                    width).bool()


def _width(episodes: Sequence[Episode]) -> int:
    return max((len(ep.token_ids) for ep in episodes), default=0)


@ESTIMATORS.register("gigpo")
class GiGPO(Stateless):
    """Critic-free step groups: episode-level plus anchor-state step-level relative advantages."""

    def __init__(self, algo: AlgoConfig, hidden_size: int = 0, seed: int = 0) -> None:
        self.algo = algo
        self._metrics: dict[str, float] = {}

    def advantages(self, episodes: Sequence[Episode], model: nn.Module | None = None,
                   pad_id: int = 0) -> Tensor:
        width = _width(episodes)
        per_turn = gigpo_advantages(episodes, self.algo.gamma, self.algo.gigpo_step_weight)
        tokens = turn_to_token_advantages(episodes, per_turn, width)
        self._metrics = {
            "credit/anchor_fraction": anchor_fraction(turn_anchor_ids(episodes)),
            "credit/turn_adv_abs_mean": _abs_mean(torch.cat([*per_turn, torch.zeros(0)])),
            "credit/adv_abs_mean": _abs_mean(tokens[_policy_tokens(episodes, width)]),
        }
        return tokens

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)


class _TurnCritic:
    """Shared by the critic estimators: the critic, its optimiser, and the per-token output.

    ``seed`` fixes the critic's initial weights (and ArCHer's replay sampling); the global
    torch RNG is left untouched, so adding a critic does not change the rest of a seeded run.
    """

    def __init__(self, algo: AlgoConfig, hidden_size: int, seed: int = 0,
                 critic_width: int = 256) -> None:
        self.algo = algo
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.critic = TurnCritic(hidden_size, critic_width)
        self.optimizer = torch.optim.Adam(self.critic.online.parameters(), lr=algo.critic_lr)
        self._metrics: dict[str, float] = {}

    def per_turn(self, episodes: Sequence[Episode],
                 features: list[TurnFeatures]) -> list[Tensor]:
        raise NotImplementedError

    def advantages(self, episodes: Sequence[Episode], model: nn.Module, pad_id: int) -> Tensor:
        width = _width(episodes)
        features = extract_turn_features(model, episodes, pad_id, next(model.parameters()).device)
        per_turn = self.per_turn(episodes, features)
        policy = _policy_tokens(episodes, width)
        tokens = whiten_masked(turn_to_token_advantages(episodes, per_turn, width), policy)
        self._metrics["credit/turn_adv_abs_mean"] = _abs_mean(torch.cat([*per_turn,
                                                                         torch.zeros(0)]))
        self._metrics["credit/adv_abs_mean"] = _abs_mean(tokens[policy])
        return tokens

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def state_dict(self) -> dict:
        return {"critic": self.critic.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.critic.load_state_dict(state["critic"])
        self.optimizer.load_state_dict(state["optimizer"])


@ESTIMATORS.register("turn_gae")
class TurnGAE(_TurnCritic):
    """GAE over turns with a learned turn-level value head (PPO with a turn-level critic)."""

    def per_turn(self, episodes: Sequence[Episode],
                 features: list[TurnFeatures]) -> list[Tensor]:
        """GAE with the current V, then V regressed on the lambda-returns.

        The advantages come from V *before* it sees this batch (as in PPO): a V just fitted to
        these returns would partly absorb each turn's own outcome into its baseline.
        """
        critic, gamma, lam = self.critic, self.algo.gamma, self.algo.gae_lambda
        per_turn, states, targets = [], [], []
        with torch.no_grad():
            for ep, feats in zip(episodes, features, strict=True):
                adv, returns = turn_gae([t.reward for t in ep.turns], critic.value(feats.states),
                                        gamma, lam, done=ep.status == "done")
                per_turn.append(adv)
                states.append(feats.states[:len(ep.turns)])
                targets.append(returns)
        states, targets = torch.cat(states), torch.cat(targets)
        losses = [value_regression_step(critic, self.optimizer, states, targets)
                  for _ in range(self.algo.critic_updates)] if len(targets) else [0.0]
        self._metrics = {"credit/v_loss": sum(losses) / len(losses),
                         "credit/value_mean": float(targets.mean()) if len(targets) else 0.0}
        return per_turn


@ESTIMATORS.register("archer")
class ArCHer(_TurnCritic):
    """ArCHer's turn-level double-Q critic trained by TD from a replay buffer; A = Q - V."""

    def __init__(self, algo: AlgoConfig, hidden_size: int, seed: int = 0) -> None:
        super().__init__(algo, hidden_size, seed)
        self.replay = ReplayBuffer(algo.replay_episodes)
        self.generator = torch.Generator().manual_seed(seed)

    def per_turn(self, episodes: Sequence[Episode],
                 features: list[TurnFeatures]) -> list[Tensor]:
        """Add the batch to the replay buffer, take TD steps, then score the batch's turns."""
        critic = self.critic
        batch = [episode_transitions(ep, f) for ep, f in zip(episodes, features, strict=True)]
        for transitions in batch:
            self.replay.add(transitions)
        stats = [archer_critic_step(critic, self.optimizer,
                                    self.replay.sample(CRITIC_BATCH, self.generator),
                                    self.algo.gamma, self.algo.critic_tau)
                 for _ in range(self.algo.critic_updates)] if len(self.replay) else []
        with torch.no_grad():
            joined = Transitions.cat(batch)
            flat = archer_advantages(*critic.q(joined.states, joined.actions),
                                     critic.value(joined.states))
        self._metrics = {
            "credit/q_loss": sum(s["q_loss"] for s in stats) / max(len(stats), 1),
            "credit/v_loss": sum(s["v_loss"] for s in stats) / max(len(stats), 1),
            "credit/replay_transitions": float(len(self.replay)),
        }
        return list(flat.split([len(ep.turns) for ep in episodes]))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "replay": self.replay.state_dict(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.replay.load_state_dict(state["replay"])
        self.generator.set_state(state["generator"])
