"""What the trainer calls for turn-level credit: per-token advantages for ``Batch.from_episodes``.

``TurnCredit(cfg.algo, model.config.hidden_size).advantages(model, episodes, pad_id)`` returns
``[B, T]`` advantages (``T`` = the longest episode, as ``Batch.from_episodes`` pads), zero off
the policy's tokens. The maths lives in ``credit.py`` (pure functions) and the critic in
``critic.py``; this object only holds the critic state across steps and wires the pieces.

Scale. Outcome GRPO gives unit-std advantages within a group. GiGPO's two terms are each already
normalised that way (the paper adds them unscaled), so they are used as they are. The critic
estimators' raw ``Q - V`` or GAE values carry the reward scale and the critic's error, so they
are whitened over the batch's policy tokens (mean 0, std 1, PPO's usual advantage
normalisation), which puts them on GRPO's scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

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
from turnrl.types import Episode

TURN_LEVEL = ("gigpo", "turn_gae", "archer")
CRITIC_BATCH = 256
"""Transitions per ArCHer critic step, sampled from the replay buffer."""


def is_turn_level(name: str) -> bool:
    """Whether advantage estimator ``name`` assigns credit per turn (needs ``TurnCredit``)."""
    return name in TURN_LEVEL


def _abs_mean(values: Tensor) -> float:
    return float(values.abs().mean()) if values.numel() else 0.0


class TurnCredit:
    """Turn-level advantages and the critic state they need between steps.

    ``seed`` fixes the critic's initial weights and its replay sampling; the global torch RNG is
    left untouched, so adding a critic does not change the rest of a seeded run.
    """

    def __init__(self, algo: AlgoConfig, hidden_size: int, *, seed: int = 0,
                 critic_width: int = 256) -> None:
        if not is_turn_level(algo.advantage):
            raise ValueError(f"{algo.advantage!r} is not a turn-level estimator; "
                             f"valid: {', '.join(TURN_LEVEL)}")
        self.algo = algo
        self._metrics: dict[str, float] = {}
        self.critic: TurnCritic | None = None
        if algo.advantage == "gigpo":
            return  # critic-free
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.critic = TurnCritic(hidden_size, critic_width)
        self.optimizer = torch.optim.Adam(self.critic.online.parameters(), lr=algo.critic_lr)
        self.replay = ReplayBuffer(algo.replay_episodes)
        self.generator = torch.Generator().manual_seed(seed)

    def advantages(self, model: nn.Module | None, episodes: Sequence[Episode],
                   pad_id: int) -> Tensor:
        """Per-token advantages ``[B, max episode length]``; trains the critic as a side effect.

        ``model`` (the policy) is only read, for critic features; gigpo takes ``None``.
        """
        width = max((len(ep.token_ids) for ep in episodes), default=0)
        policy_tokens = turn_to_token_advantages(
            episodes, [torch.ones(len(ep.turns)) for ep in episodes], width).bool()
        name = self.algo.advantage
        if name == "gigpo":
            per_turn = gigpo_advantages(episodes, self.algo.gamma, self.algo.gigpo_step_weight)
            self._metrics = {"credit/anchor_fraction": anchor_fraction(turn_anchor_ids(episodes))}
            tokens = turn_to_token_advantages(episodes, per_turn, width)
        else:
            device = next(model.parameters()).device
            features = extract_turn_features(model, episodes, pad_id, device)
            per_turn = (self._turn_gae if name == "turn_gae" else self._archer)(episodes, features)
            tokens = whiten_masked(turn_to_token_advantages(episodes, per_turn, width),
                                   policy_tokens)
        raw = torch.cat([*per_turn, torch.zeros(0)])  # the extra empty tensor: no episodes
        self._metrics["credit/turn_adv_abs_mean"] = _abs_mean(raw)
        self._metrics["credit/adv_abs_mean"] = _abs_mean(tokens[policy_tokens])
        return tokens

    def _turn_gae(self, episodes: Sequence[Episode],
                  features: list[TurnFeatures]) -> list[Tensor]:
        """GAE with the current V, then V regressed on the lambda-returns.

        The advantages come from V *before* it sees this batch (as in PPO): a V just fitted to
        these returns would partly absorb each turn's own outcome into its baseline.
        """
        critic, gamma, lam = self.critic, self.algo.gamma, self.algo.gae_lambda
        per_turn, states, targets = [], [], []
        with torch.no_grad():
            for ep, feats in zip(episodes, features, strict=True):
                values = critic.value(feats.states)
                adv, returns = turn_gae([t.reward for t in ep.turns], values, gamma, lam,
                                        done=ep.status == "done")
                per_turn.append(adv)
                states.append(feats.states[:len(ep.turns)])
                targets.append(returns)
        states, targets = torch.cat(states), torch.cat(targets)
        losses = [value_regression_step(critic, self.optimizer, states, targets)
                  for _ in range(self.algo.critic_updates)] if len(targets) else [0.0]
        self._metrics = {"credit/v_loss": sum(losses) / len(losses),
                         "credit/value_mean": float(targets.mean()) if len(targets) else 0.0}
        return per_turn

    def _archer(self, episodes: Sequence[Episode],
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

    def metrics(self) -> dict[str, float]:
        """Metrics of the last ``advantages`` call: critic losses, mean |advantage| (per turn
        before normalisation, and per policy token after), gigpo's anchor fraction."""
        return dict(self._metrics)

    def state_dict(self) -> dict:
        """Everything a resume needs: critic and target weights, optimiser, replay, sampler."""
        if self.critic is None:
            return {}
        return {"critic": self.critic.state_dict(), "optimizer": self.optimizer.state_dict(),
                "replay": self.replay.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if self.critic is None:
            return
        self.critic.load_state_dict(state["critic"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.replay.load_state_dict(state["replay"])
        self.generator.set_state(state["generator"])
