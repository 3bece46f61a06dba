"""One interface for every advantage estimator, outcome-level and turn-level alike.

An estimator turns a step's scored episodes into advantages for ``Batch.from_episodes``:
``[B]`` (one per episode, broadcast over its tokens) or ``[B, T]`` (per token, ``T`` = the
longest episode, zero off the policy's tokens). Estimators that learn (a critic) keep their
state between steps and hand it to checkpoints through ``state_dict``/``load_state_dict``.

Adding one: write a class with the ``AdvantageEstimator`` methods (or wrap a pure function
``(rewards [N], group_ids [N]) -> [N]`` in ``Outcome``) and register a factory
``(settings: EstimatorSettings) -> estimator`` with
``@ESTIMATORS.register("name", level="turn", options=("gamma", ...))``: its level (episode, turn
or token) and the ``critic`` section options it reads. The config then accepts
``algo.advantage: name`` (and suggests the closest name for a typo), hands the estimator those
options in ``settings.critic``, and refuses a critic option it does not read.

The maths lives elsewhere, as pure functions: ``advantages.py`` (GRPO, Dr. GRPO, RLOO,
REINFORCE++), ``credit.py`` (GiGPO, turn-level GAE, ArCHer's Q - V) and ``critic.py`` (the
turn-level critic and its updates). Scale: outcome GRPO gives unit-std advantages within a
group; GiGPO's two terms are each already normalised that way (the paper adds them unscaled).
The critic estimators' raw ``Q - V`` or GAE values carry the reward scale and the critic's
error, so by default they are whitened over the batch's policy tokens (PPO's usual
normalisation).

The ``critic`` config section (``turnrl/config/critic.py``) holds every turn-level setting,
including how a critic's advantages reach the policy. A young critic is wrong, and whitening
turns its errors into full-size policy steps, so ``warmup_updates`` / ``warmup_max_error`` give
the policy the outcome GRPO advantage until the critic has trained for long enough / fits the
batch's returns well enough, and ``scale`` can replace the whitening by a running RMS or
nothing.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from turnrl.algorithms.advantages import ADVANTAGE_FNS, grpo_advantages, rae_advantages
from turnrl.algorithms.credit import (
    anchor_fraction,
    archer_advantages,
    discounted_returns,
    episode_group_ids,
    gae,
    gigpo_advantages,
    relative_fit_error,
    token_steps,
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
    extract_token_states,
    extract_turn_features,
    value_regression_step,
)
from turnrl.algorithms.tree import tree_grpo_advantages
from turnrl.config import AlgoConfig, Config, CriticConfig, check_critic_options
from turnrl.registry import ESTIMATORS
from turnrl.types import Episode

CRITIC_BATCH = 256
"""Transitions per ArCHer critic step, sampled from the replay buffer."""
RUNNING_DECAY = 0.9
"""``critic.scale: running``: the mean square of the advantages is an exponential average
with this decay per step (bias-corrected as in Adam), so it follows the critic within ~10
steps."""


class AdvantageEstimator(Protocol):
    def advantages(self, episodes: Sequence[Episode], model: nn.Module, pad_id: int) -> Tensor:
        """``[B]`` or ``[B, T]`` advantages; may train the estimator's own critic."""

    def metrics(self) -> dict[str, float]:
        """What the last ``advantages`` call measured (critic losses, ...); may be empty."""

    def state_dict(self) -> dict:
        """Everything a resume needs; ``{}`` for stateless estimators."""

    def load_state_dict(self, state: dict) -> None: ...


@dataclass(frozen=True)
class EstimatorSettings:
    """What every estimator factory gets: ``factory(settings) -> estimator``."""

    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    """the ``critic`` section; an estimator reads the options it declared"""
    hidden_size: int = 0
    """the policy's hidden size (what a critic reading its hidden states takes in)"""
    seed: int = 0

    @classmethod
    def from_config(cls, cfg: Config, hidden_size: int) -> EstimatorSettings:
        return cls(cfg.algo, cfg.critic, hidden_size, cfg.run.seed)


def make_estimator(settings: EstimatorSettings) -> AdvantageEstimator:
    """The estimator ``settings.algo.advantage`` names, built by its registered factory; a
    critic option it does not read is refused (as the config does)."""
    check_critic_options(settings.algo.advantage, settings.critic)
    return ESTIMATORS[settings.algo.advantage].factory(settings)


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
        groups = episode_group_ids(episodes)
        return self.fn(rewards, groups)


for _name, _fn in ADVANTAGE_FNS.items():
    ESTIMATORS.add(_name, lambda settings, fn=_fn: Outcome(fn), level="episode")


@ESTIMATORS.register("rae", level="episode")
class RoleConditioned(Stateless):
    """RAE (``rae_advantages``): one running baseline per (env, role), the role read from
    ``info["role"]`` (the games name it; an env without roles has one baseline). For
    self-play and fixed-opponent games, where a role's returns differ by design (Kuhn
    Poker's first seat is worth -1/18): GRPO's group baseline would ignore that, and
    SPIRAL reports that without RAE training collapses."""

    def __init__(self, settings: EstimatorSettings | None = None) -> None:
        self.baselines: dict[str, float] = {}

    def advantages(self, episodes: Sequence[Episode], model: nn.Module, pad_id: int) -> Tensor:
        rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float32)
        keys = [f"{ep.env}/{ep.info.get('role', '')}" for ep in episodes]
        advantages, self.baselines = rae_advantages(rewards, keys, self.baselines)
        return advantages

    def metrics(self) -> dict[str, float]:
        return {f"rae/baseline/{key}": value for key, value in self.baselines.items()}

    def state_dict(self) -> dict:
        return {"baselines": dict(self.baselines)}

    def load_state_dict(self, state: dict) -> None:
        self.baselines = dict(state.get("baselines", {}))


def _policy_tokens(episodes: Sequence[Episode], width: int) -> Tensor:
    """``[B, width]`` bool: the tokens the policy sampled."""
    return turn_to_token_advantages(episodes, [torch.ones(len(ep.turns)) for ep in episodes],
                                    width).bool()


def _width(episodes: Sequence[Episode]) -> int:
    return max((len(ep.token_ids) for ep in episodes), default=0)


GIGPO_OPTIONS = ("gamma", "gigpo_step_weight", "gigpo_episode_weight")
CRITIC_OPTIONS = ("gamma", "lr", "updates", "warmup_updates", "warmup_max_error", "scale",
                  "features")
"""What every critic estimator reads; each adds its own (GAE's lambda, ArCHer's tau, ...)."""


@ESTIMATORS.register("gigpo", level="turn", options=GIGPO_OPTIONS)
class GiGPO(Stateless):
    """Critic-free step groups: episode-level plus anchor-state step-level relative advantages."""

    def __init__(self, settings: EstimatorSettings) -> None:
        self.options = settings.critic
        self._metrics: dict[str, float] = {}

    def advantages(self, episodes: Sequence[Episode], model: nn.Module | None = None,
                   pad_id: int = 0) -> Tensor:
        width = _width(episodes)
        c = self.options
        per_turn = gigpo_advantages(episodes, c.gamma, c.gigpo_step_weight,
                                    episode_weight=c.gigpo_episode_weight)
        tokens = turn_to_token_advantages(episodes, per_turn, width)
        self._metrics = {
            "credit/anchor_fraction": anchor_fraction(turn_anchor_ids(episodes)),
            "credit/turn_adv_abs_mean": _abs_mean(torch.cat([*per_turn, torch.zeros(0)])),
            "credit/adv_abs_mean": _abs_mean(tokens[_policy_tokens(episodes, width)]),
        }
        return tokens

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)


@ESTIMATORS.register("tree_grpo", level="turn")
class TreeGRPO(Stateless):
    """Tree-GRPO over tree rollouts (``rollout.branch``; ``tree.py``): each turn's node value
    against its siblings under the same fork, plus against the whole group. The tree is read
    from ``info["branch"]`` (rollout/branch.py); episodes without it are one-node trees, so
    without forks this is outcome GRPO per turn."""

    def __init__(self, settings: EstimatorSettings | None = None) -> None:
        self._metrics: dict[str, float] = {}

    def advantages(self, episodes: Sequence[Episode], model: nn.Module | None = None,
                   pad_id: int = 0) -> Tensor:
        rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float32)
        trees = [ep.info.get("branch") or {} for ep in episodes]
        groups = episode_group_ids(episodes)
        # a tree's id, unique across turn loops (``root`` is only unique within one); unforked:
        # its own tree
        roots = [t.get("tree", -1 - b) for b, t in enumerate(trees)]
        per_turn = tree_grpo_advantages(
            rewards, groups, roots, [tuple(tuple(fork) for fork in t.get("path", ()))
                                     for t in trees], [len(ep.turns) for ep in episodes])
        width = _width(episodes)
        tokens = turn_to_token_advantages(episodes, per_turn, width)
        self._metrics = {
            "tree/leaves_per_root": len(episodes) / max(len(set(zip(groups.tolist(), roots,
                                                                    strict=True))), 1),
            "tree/turn_adv_abs_mean": _abs_mean(torch.cat([*per_turn, torch.zeros(0)])),
            # each token counted once, by the leaf that sampled it (a copy's prefix is masked)
            "tree/sampled_tokens": float(sum(ep.num_policy_tokens for ep in episodes)),
        }
        return tokens

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)


def grpo_per_turn(episodes: Sequence[Episode]) -> list[Tensor]:
    """The outcome GRPO advantage of each episode, repeated on each of its turns."""
    rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float32)
    groups = episode_group_ids(episodes)
    per_episode = grpo_advantages(rewards, groups) if episodes else rewards
    return [per_episode[b].repeat(len(ep.turns)) for b, ep in enumerate(episodes)]


def critic_fit_error(critic: TurnCritic, episodes: Sequence[Episode],
                     features: list[TurnFeatures], gamma: float) -> float:
    """``relative_fit_error`` of V at every turn against the turn's discounted return (the
    Monte-Carlo value of the policy that played the batch)."""
    with torch.no_grad():
        values = [critic.value(f.states[:len(ep.turns)]) for ep, f in zip(episodes, features,
                                                                            strict=True)]
    returns = [discounted_returns([t.reward for t in ep.turns], gamma) for ep in episodes]
    return relative_fit_error(torch.cat([*values, torch.zeros(0)]),
                              torch.cat([*returns, torch.zeros(0)]))


class _TurnCritic:
    """Shared by the critic estimators: the critic, its optimiser, the warm-up and the
    per-token output.

    ``seed`` fixes the critic's initial weights (and ArCHer's replay sampling); the global
    torch RNG is left untouched, so adding a critic does not change the rest of a seeded run.
    ``updates`` counts the critic's gradient steps; subclasses set ``updates_at_scoring`` to it
    when they compute the batch's advantages, which is what the warm-up compares.
    """

    def __init__(self, settings: EstimatorSettings, critic_width: int = 256) -> None:
        self.options = settings.critic
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(settings.seed)
            self.critic = TurnCritic(settings.hidden_size, critic_width)
        self.optimizer = torch.optim.Adam(self.critic.online.parameters(), lr=self.options.lr)
        self.updates = self.updates_at_scoring = 0
        self.running_square, self.running_steps = 0.0, 0
        self.feature_model: nn.Module | None = None  # critic.features: frozen
        self._frozen_state: dict | None = None  # its weights from a checkpoint, until needed
        self._metrics: dict[str, float] = {}

    def feature_source(self, model: nn.Module) -> nn.Module:
        """What the critic reads: the live policy or the frozen starting copy."""
        if self.options.features != "frozen":
            return model
        if self.feature_model is None:
            self.feature_model = copy.deepcopy(model).eval().requires_grad_(False)
            if self._frozen_state is not None:  # resumed: the weights frozen at the start
                self.feature_model.load_state_dict(self._frozen_state)
                self._frozen_state = None
        return self.feature_model

    def features(self, episodes: Sequence[Episode], model: nn.Module,
                 pad_id: int) -> list[TurnFeatures]:
        """The critic's inputs at the turn boundaries."""
        source = self.feature_source(model)
        return extract_turn_features(source, episodes, pad_id, next(source.parameters()).device)

    def per_turn(self, episodes: Sequence[Episode],
                 features: list[TurnFeatures]) -> list[Tensor]:
        raise NotImplementedError

    def critic_ready(self, fit_error: float) -> bool:
        """Past the warm-up: enough critic steps before scoring, and (if asked) a good fit."""
        c = self.options
        return self.updates_at_scoring >= c.warmup_updates and (
            c.warmup_max_error == 0 or fit_error <= c.warmup_max_error)

    def scaled(self, tokens: Tensor, policy: Tensor) -> Tensor:
        """The critic's per-token advantages in ``critic.scale``."""
        if self.options.scale == "batch":
            return whiten_masked(tokens, policy)
        if self.options.scale == "none":
            return tokens
        picked = tokens[policy]
        if picked.numel():  # running: an Adam-style bias-corrected mean square
            self.running_steps += 1
            self.running_square = (RUNNING_DECAY * self.running_square
                                   + (1 - RUNNING_DECAY) * float(picked.pow(2).mean()))
        if self.running_steps == 0:
            return tokens
        rms = math.sqrt(self.running_square / (1 - RUNNING_DECAY ** self.running_steps))
        return tokens / (rms + 1e-6)

    def advantages(self, episodes: Sequence[Episode], model: nn.Module, pad_id: int) -> Tensor:
        width = _width(episodes)
        features = self.features(episodes, model, pad_id)
        fit_error = critic_fit_error(self.critic, episodes, features, self.options.gamma)
        per_turn = self.per_turn(episodes, features)  # trains the critic
        self._metrics["credit/turn_adv_abs_mean"] = _abs_mean(torch.cat([*per_turn,
                                                                         torch.zeros(0)]))
        return self.to_policy(episodes, turn_to_token_advantages(episodes, per_turn, width),
                              fit_error)

    def to_policy(self, episodes: Sequence[Episode], critic_tokens: Tensor,
                  fit_error: float) -> Tensor:
        """The ``[B, T]`` advantages the policy gets: the critic's in ``critic.scale``, or
        GRPO's while the critic is warming up."""
        width = critic_tokens.shape[1]
        policy = _policy_tokens(episodes, width)
        critic_tokens = self.scaled(critic_tokens, policy)
        use_critic = self.critic_ready(fit_error)
        tokens = (critic_tokens if use_critic
                  else turn_to_token_advantages(episodes, grpo_per_turn(episodes), width))
        self._metrics["credit/adv_abs_mean"] = _abs_mean(tokens[policy])
        self._metrics["credit/critic_fit_error"] = min(fit_error, 1e6)  # inf breaks JSON
        self._metrics["credit/critic_in_use"] = float(use_critic)
        self._metrics["credit/critic_updates"] = float(self.updates)
        return tokens

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def state_dict(self) -> dict:
        state = {"critic": self.critic.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "updates": self.updates, "running": [self.running_square, self.running_steps]}
        frozen = (self.feature_model.state_dict() if self.feature_model is not None
                  else self._frozen_state)
        return {**state, "feature_model": frozen} if frozen is not None else state

    def load_state_dict(self, state: dict) -> None:
        self.critic.load_state_dict(state["critic"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state.get("updates", 0))  # checkpoints from before the warm-up
        self.running_square, self.running_steps = state.get("running", [0.0, 0])
        self.feature_model, self._frozen_state = None, state.get("feature_model")


@ESTIMATORS.register("turn_gae", level="turn", options=(*CRITIC_OPTIONS, "gae_lambda"))
class TurnGAE(_TurnCritic):
    """GAE over turns with a learned turn-level value head (PPO with a turn-level critic)."""

    def per_turn(self, episodes: Sequence[Episode],
                 features: list[TurnFeatures]) -> list[Tensor]:
        """GAE with the current V, then V regressed on the lambda-returns.

        The advantages come from V *before* it sees this batch (as in PPO): a V just fitted to
        these returns would partly absorb each turn's own outcome into its baseline.
        """
        critic, gamma, lam = self.critic, self.options.gamma, self.options.gae_lambda
        per_turn, states, targets = [], [], []
        self.updates_at_scoring = self.updates
        with torch.no_grad():
            for ep, feats in zip(episodes, features, strict=True):
                adv, returns = turn_gae([t.reward for t in ep.turns], critic.value(feats.states),
                                        gamma, lam, done=ep.status == "done")
                per_turn.append(adv)
                states.append(feats.states[:len(ep.turns)])
                targets.append(returns)
        states, targets = torch.cat(states), torch.cat(targets)
        losses = [value_regression_step(critic, self.optimizer, states, targets)
                  for _ in range(self.options.updates)] if len(targets) else [0.0]
        self.updates += self.options.updates if len(targets) else 0
        self._metrics = {"credit/v_loss": sum(losses) / len(losses),
                         "credit/value_mean": float(targets.mean()) if len(targets) else 0.0}
        return per_turn


@ESTIMATORS.register("token_gae", level="token",
                     options=(*CRITIC_OPTIONS, "token_lambda", "value_clip"))
class TokenGAE(_TurnCritic):
    """PPO with a token-level critic: a value head on the policy's hidden state before every
    policy token, GAE over the policy tokens of the whole episode (``credit.token_steps``:
    environment tokens carry no value step, ``gamma`` per turn, ``token_lambda`` per token),
    and the value head regressed on the lambda-returns with PPO's value clipping
    (``value_clip``). Open-Reasoner-Zero and VAPO train such a critic as a second language
    model; here it is the turn critic's MLP head on the (detached) policy features, so it adds
    one no-grad forward per step, not a second model's update.
    """

    def advantages(self, episodes: Sequence[Episode], model: nn.Module, pad_id: int) -> Tensor:
        c = self.options
        steps = [token_steps(ep, c.gamma) for ep in episodes]
        source = self.feature_source(model)
        states = extract_token_states(source, episodes, [pos for pos, _, _ in steps], pad_id,
                                      next(source.parameters()).device)
        self.updates_at_scoring = self.updates
        tokens = torch.zeros(len(episodes), _width(episodes))
        old_values, targets, returns = [], [], []
        with torch.no_grad():  # V before it sees this batch scores it (as in turn_gae)
            for b, (ep, (pos, rewards, discounts), st) in enumerate(zip(episodes, steps, states,
                                                                         strict=True)):
                values = self.critic.value(st)
                adv, lam_returns = gae(rewards, values, discounts, c.token_lambda,
                                       done=ep.status == "done")
                tokens[b, pos] = adv
                old_values.append(values[:-1])
                targets.append(lam_returns)
                returns.append(gae(rewards, torch.zeros(len(rewards) + 1), discounts, 1.0)[1])
        old, target = torch.cat([*old_values, torch.zeros(0)]), torch.cat([*targets,
                                                                           torch.zeros(0)])
        fit_error = relative_fit_error(old, torch.cat([*returns, torch.zeros(0)]))
        self.train_values(torch.cat([st[:-1] for st in states]), old, target)
        return self.to_policy(episodes, tokens, fit_error)

    def train_values(self, states: Tensor, old_values: Tensor, targets: Tensor) -> None:
        """``critic.updates`` full-batch steps of the clipped value loss over every token."""
        c = self.options
        losses = [value_regression_step(self.critic, self.optimizer, states, targets,
                                        old_values=old_values, clip=c.value_clip)
                  for _ in range(c.updates)] if len(targets) else [0.0]
        self.updates += c.updates if len(targets) else 0
        self._metrics = {"credit/v_loss": sum(losses) / len(losses),
                         "credit/value_mean": float(targets.mean()) if len(targets) else 0.0}
        if c.value_clip and len(targets):  # tokens whose V reached the clip range's edge
            with torch.no_grad():
                moved = (self.critic.value(states) - old_values).abs()
            self._metrics["credit/value_clip_fraction"] = float((moved >= c.value_clip).float()
                                                                .mean())


@ESTIMATORS.register("archer", level="turn",
                     options=(*CRITIC_OPTIONS, "tau", "replay_episodes"))
class ArCHer(_TurnCritic):
    """ArCHer's turn-level double-Q critic trained by TD from a replay buffer; A = Q - V."""

    def __init__(self, settings: EstimatorSettings) -> None:
        super().__init__(settings)
        self.replay = ReplayBuffer(self.options.replay_episodes)
        self.generator = torch.Generator().manual_seed(settings.seed)

    def per_turn(self, episodes: Sequence[Episode],
                 features: list[TurnFeatures]) -> list[Tensor]:
        """Add the batch to the replay buffer, take TD steps, then score the batch's turns."""
        critic = self.critic
        batch = [episode_transitions(ep, f) for ep, f in zip(episodes, features, strict=True)]
        for transitions in batch:
            self.replay.add(transitions)
        stats = [archer_critic_step(critic, self.optimizer,
                                    self.replay.sample(CRITIC_BATCH, self.generator),
                                    self.options.gamma, self.options.tau)
                 for _ in range(self.options.updates)] if len(self.replay) else []
        self.updates += len(stats)
        self.updates_at_scoring = self.updates  # scored with the critic after this batch's steps
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
