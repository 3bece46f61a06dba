"""The turn-level critic: small MLP heads on the policy's own hidden states.

Design. A turn's state is everything the policy saw before it answered; its state-action is that
plus the answer. The policy's final hidden state at the last token before the action (``s``)
and at the last token of the action (``s, a``) already summarise both, so the critic reads those
vectors instead of running a second language model: on CPU a second model would double the
cost of every step, while one ``torch.no_grad()`` forward of the policy over the episode token
ids gives the hidden state at every turn boundary of every episode at once. The features are
detached, so critic training never touches the policy's weights.

Heads (ArCHer, Zhou et al. 2024, arXiv:2402.19446): two Q heads on ``[h(s), h(s, a)]``
(double Q; the value target takes their minimum) and one V head on ``h(s)``, each with a target
copy updated by Polyak averaging (``tau``). For ArCHer the heads are trained off-policy by TD
from a replay buffer of turn transitions ``(h(s), h(s, a), r, h(s'), done)`` holding the last
``replay_episodes`` episodes. For turn-level GAE only the V head is used, regressed on the
lambda-returns of the current batch (on-policy, as PPO trains its value function).

The price: a stored feature is the hidden state of the policy *that collected it*. As the
policy trains, the same state maps to a drifting vector, so old replay transitions are
slightly stale inputs, and the critic has to track a moving representation. A separate critic
model would avoid this at the cost of a second model's forward and backward on every step.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor, nn

from turnrl.algorithms.credit import td_targets, value_targets
from turnrl.learner.shard import through_root
from turnrl.types import Episode


class TurnFeatures(NamedTuple):
    """One episode's critic inputs. ``states`` ``[T+1, H]``: ``h(s_0) .. h(s_T)``, where row
    ``t < T`` is the hidden state at the last token before turn ``t``'s action and row ``T`` the
    one at the episode's last token (the state after the last action). ``actions`` ``[T, H]``:
    the hidden state at the last token of each turn's action."""

    states: Tensor
    actions: Tensor


@torch.no_grad()
def hidden_at(model: nn.Module, episodes: Sequence[Episode], positions: Sequence[Sequence[int]],
              pad_id: int, device: torch.device | str, batch_size: int = 8) -> list[Tensor | None]:
    """The policy's final hidden states at ``positions[i]`` of episode ``i``: ``[len, H]``
    float32 on CPU each (None for an episode with no tokens).

    Episodes are padded on the right and run through the decoder ``batch_size`` at a time,
    longest first (less padding); causal attention keeps padding from changing real positions.
    """
    decoder = model.get_decoder()
    was_training = model.training
    model.eval()  # no dropout in the features
    out: list[Tensor | None] = [None] * len(episodes)
    order = sorted(range(len(episodes)), key=lambda i: -len(episodes[i].token_ids))
    try:
        for first in range(0, len(order), batch_size):
            rows = [i for i in order[first:first + batch_size] if episodes[i].token_ids]
            if not rows:
                continue
            width = len(episodes[rows[0]].token_ids)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for row, i in enumerate(rows):
                n = len(episodes[i].token_ids)
                ids[row, :n] = torch.tensor(episodes[i].token_ids)
                mask[row, :n] = 1
            hidden = through_root(model, decoder, input_ids=ids.to(device),
                                  attention_mask=mask.to(device)).last_hidden_state
            for row, i in enumerate(rows):
                out[i] = hidden[row, list(positions[i])].float().cpu()
    finally:
        model.train(was_training)
    return out


def extract_turn_features(model: nn.Module, episodes: Sequence[Episode], pad_id: int,
                          device: torch.device | str, batch_size: int = 8) -> list[TurnFeatures]:
    """Final hidden states at the turn boundaries of ``episodes``, float32 on CPU."""
    hidden_size = model.config.hidden_size
    positions = []
    for ep in episodes:
        state_at = [max(t.start - 1, 0) for t in ep.turns] + [len(ep.token_ids) - 1]
        positions.append(state_at + [max(t.end - 1, 0) for t in ep.turns])
    hidden = hidden_at(model, episodes, positions, pad_id, device, batch_size)
    empty = TurnFeatures(torch.zeros(1, hidden_size), torch.zeros(0, hidden_size))
    return [TurnFeatures(h[:len(ep.turns) + 1], h[len(ep.turns) + 1:]) if h is not None
            else empty for ep, h in zip(episodes, hidden, strict=True)]  # no tokens: empty


def extract_token_states(model: nn.Module, episodes: Sequence[Episode],
                         token_positions: Sequence[Tensor], pad_id: int,
                         device: torch.device | str, batch_size: int = 8) -> list[Tensor]:
    """The token-level critic's inputs: ``[N+1, H]`` per episode, row ``i < N`` the hidden
    state just before policy token ``token_positions[i]`` (what the policy saw when it chose
    it) and row ``N`` the one at the episode's last token (the state after the last step)."""
    positions = [[max(int(p) - 1, 0) for p in pos] + [max(len(ep.token_ids) - 1, 0)]
                 for ep, pos in zip(episodes, token_positions, strict=True)]
    hidden = hidden_at(model, episodes, positions, pad_id, device, batch_size)
    size = model.config.hidden_size
    return [h if h is not None else torch.zeros(len(pos), size)
            for h, pos in zip(hidden, positions, strict=True)]


@dataclass
class Transitions:
    """Turn transitions ``(h(s), h(s, a), r, h(s'), done)``; all tensors share dim 0 ``[N]``."""

    states: Tensor
    actions: Tensor
    rewards: Tensor
    next_states: Tensor
    dones: Tensor

    def __len__(self) -> int:
        return self.rewards.numel()

    def select(self, index: Tensor) -> Transitions:
        return Transitions(*(getattr(self, f.name)[index] for f in fields(self)))

    @classmethod
    def cat(cls, parts: Sequence[Transitions]) -> Transitions:
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)))


def episode_transitions(episode: Episode, features: TurnFeatures) -> Transitions:
    """One transition per turn. A turn with no reward is still a transition; ``done`` is set only
    on the last turn of an episode whose status is ``"done"``: a truncated (or failed) episode
    did not terminate, so its last turn bootstraps from the state it stopped in."""
    turns = len(episode.turns)
    dones = torch.zeros(turns)
    if turns and episode.status == "done":
        dones[-1] = 1.0
    return Transitions(states=features.states[:turns], actions=features.actions,
                       rewards=torch.tensor([t.reward for t in episode.turns],
                                            dtype=torch.float32),
                       next_states=features.states[1:turns + 1], dones=dones)


class ReplayBuffer:
    """The transitions of the last ``capacity`` episodes (evicted whole episodes at a time)."""

    def __init__(self, capacity: int) -> None:
        self.episodes: deque[Transitions] = deque(maxlen=capacity)
        self._joined: Transitions | None = None

    def add(self, transitions: Transitions) -> None:
        if len(transitions):
            self.episodes.append(transitions)
            self._joined = None

    def __len__(self) -> int:
        return sum(len(t) for t in self.episodes)

    def all(self) -> Transitions:
        if self._joined is None:
            self._joined = Transitions.cat(list(self.episodes))
        return self._joined

    def sample(self, size: int, generator: torch.Generator) -> Transitions:
        """``min(size, len)`` transitions drawn without replacement."""
        joined = self.all()
        return joined.select(torch.randperm(len(joined), generator=generator)[:size])

    def state_dict(self) -> dict:
        return {"capacity": self.episodes.maxlen,
                "episodes": [{f.name: getattr(t, f.name) for f in fields(t)}
                             for t in self.episodes]}

    def load_state_dict(self, state: dict) -> None:
        self.episodes = deque((Transitions(**t) for t in state["episodes"]),
                              maxlen=state["capacity"])
        self._joined = None


def _head(in_features: int, width: int) -> nn.Sequential:
    # LayerNorm first: LLM hidden states have a few large-magnitude dimensions.
    return nn.Sequential(nn.LayerNorm(in_features), nn.Linear(in_features, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))


class TurnCritic(nn.Module):
    """Q1, Q2 on ``[h(s), h(s, a)]`` and V on ``h(s)``, plus frozen target copies."""

    def __init__(self, hidden_size: int, width: int = 256) -> None:
        super().__init__()
        self.online = nn.ModuleDict({"q1": _head(2 * hidden_size, width),
                                     "q2": _head(2 * hidden_size, width),
                                     "v": _head(hidden_size, width)})
        self.target = copy.deepcopy(self.online).requires_grad_(False)

    def _heads(self, target: bool) -> nn.ModuleDict:
        return self.target if target else self.online

    def q(self, states: Tensor, actions: Tensor, target: bool = False) -> tuple[Tensor, Tensor]:
        """``Q1, Q2 (s, a)``: ``[N, H], [N, H] -> [N], [N]``."""
        heads, x = self._heads(target), torch.cat([states, actions], dim=-1)
        return heads["q1"](x).squeeze(-1), heads["q2"](x).squeeze(-1)

    def value(self, states: Tensor, target: bool = False) -> Tensor:
        """``V(s)``: ``[N, H] -> [N]``."""
        return self._heads(target)["v"](states).squeeze(-1)

    @torch.no_grad()
    def polyak_update(self, tau: float) -> None:
        """``target <- (1 - tau) target + tau online``."""
        for target, online in zip(self.target.parameters(), self.online.parameters(),
                                  strict=True):
            target.lerp_(online, tau)


def _step(critic: TurnCritic, optimizer: torch.optim.Optimizer, loss: Tensor,
          max_grad_norm: float) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(critic.online.parameters(), max_grad_norm)
    optimizer.step()


def archer_critic_step(critic: TurnCritic, optimizer: torch.optim.Optimizer,
                       batch: Transitions, gamma: float, tau: float,
                       max_grad_norm: float = 1.0) -> dict[str, float]:
    """One TD step of all three heads, then a Polyak update of the targets (ArCHer).

    ``Q_i(s, a) -> r + gamma (1 - done) V_target(s')`` and
    ``V(s) -> min(Q1_target, Q2_target)(s, a)``, mean squared errors summed.
    """
    with torch.no_grad():
        q_target = td_targets(batch.rewards, critic.value(batch.next_states, target=True),
                              batch.dones, gamma)
        v_target = value_targets(*critic.q(batch.states, batch.actions, target=True))
    q1, q2 = critic.q(batch.states, batch.actions)
    q_loss = (q1 - q_target).pow(2).mean() + (q2 - q_target).pow(2).mean()
    v_loss = (critic.value(batch.states) - v_target).pow(2).mean()
    _step(critic, optimizer, q_loss + v_loss, max_grad_norm)
    critic.polyak_update(tau)
    return {"q_loss": float(q_loss.detach()) / 2, "v_loss": float(v_loss.detach())}


def clipped_value_loss(values: Tensor, old_values: Tensor, targets: Tensor,
                       clip: float) -> Tensor:
    """PPO's clipped value loss (Schulman et al. 2017, as in OpenAI baselines' ppo2):
    ``mean(max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2))``. ``[N], [N], [N] -> []``.
    ``clip = 0``: plain mean squared error. Once V has moved more than ``c`` from the values
    the advantages were computed with, a step further from them gets no gradient."""
    loss = (values - targets).pow(2)
    if clip > 0:
        moved = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (moved - targets).pow(2))
    return loss.mean()


def value_regression_step(critic: TurnCritic, optimizer: torch.optim.Optimizer,
                          states: Tensor, targets: Tensor, max_grad_norm: float = 1.0, *,
                          old_values: Tensor | None = None, clip: float = 0.0) -> float:
    """One step of ``V(s) -> target`` (mean squared error; clipped around ``old_values`` when
    ``clip > 0``, ``clipped_value_loss``); returns the loss before the step."""
    values = critic.value(states)
    old = values.detach() if old_values is None else old_values
    loss = clipped_value_loss(values, old, targets, clip)
    _step(critic, optimizer, loss, max_grad_norm)
    return float(loss.detach())
