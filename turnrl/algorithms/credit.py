"""Turn-level credit assignment: each policy turn (one action) gets its own advantage.

Outcome estimators (``advantages.py``) give every token of an episode the same advantage; in a
long multi-turn episode that cannot tell the decisive turn from a wasted one. The functions here
score turns, then ``turn_to_token_advantages`` spreads each turn's score over the tokens the
policy sampled in that turn (``Turn.start:Turn.end``). A "step" below is one turn.

Papers:
- GiGPO: Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training"
  (arXiv:2505.10978): episode-level relative advantage (their eq. 3), anchor-state step groups
  (eq. 6), discounted step returns (eq. 5), step-level relative advantage (eq. 7), and the sum
  ``A = A_E + omega * A_S`` (eq. 8).
- GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation" (arXiv:1506.02438), applied with one step per turn (``turn_gae``) or one step per
  policy token (``token_gae``, PPO with a token-level value model as in Open-Reasoner-Zero,
  Hu et al. 2025, arXiv:2503.24290, and VAPO, Yue et al. 2025, arXiv:2504.05118).
- ArCHer: Zhou et al. 2024, "ArCHer: Training Language Model Agents via Hierarchical Multi-Turn
  RL" (arXiv:2402.19446): an utterance-level (turn-level) critic trained by TD, whose advantage
  ``Q(s, a) - V(s)`` drives the token-level policy.

Departures:
- GiGPO normalises with ``F_norm = std`` (the paper's "w/ std" variant; ``std_normalize=False``
  gives its ``F_norm = 1`` variant). Std is the sample std with ``eps`` as in ``advantages.py``,
  so an episode group or anchor group of one, or of all-equal values, gets advantage 0.
- GiGPO's episode-level mean and std are taken over the episodes of a group, as in the paper's
  eq. 3 (the authors' public code can instead take them over all steps, which weighs long
  episodes more). The episode return is ``Episode.reward``, the same score the outcome
  estimators use, so ``step_weight = 0`` reproduces GRPO exactly.
- Anchor states match by exact ``Turn.state`` key (the paper's exact-match grouping). A turn with
  an empty key has no known state and forms its own (singleton) anchor group.
- Token-level GAE steps only over the policy's tokens: environment and prompt tokens carry no
  value step (they are part of the transition from a turn's last token to the next turn's
  first). A turn's reward arrives on its last policy token, and the discount ``gamma`` applies
  per *turn* (when a turn ends), not per token, so ``critic.gamma`` means the same for every
  estimator; within a turn the discount is 1, as Open-Reasoner-Zero and VAPO use for single
  replies. ``lambda`` decays per token.
- ArCHer trains ``V(s)`` towards ``Q_target(s, a')`` with ``a'`` a fresh sample from the current
  policy. Sampling a new utterance for every replayed state would cost a generation pass, so we
  use the action that was taken (``value_targets``): the estimate is of the behaviour policy's
  value, close to the current one for recent episodes. With two target Q heads we take their
  minimum (clipped double-Q, Fujimoto et al. 2018). The authors' code instead pairs each Q head
  with its own V head and applies the minimum only when forming the advantage
  ``min(Q1, Q2) - min(V1, V2)``; we keep one V head, so the advantage is ``min(Q1, Q2) - V``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from turnrl.algorithms.advantages import dr_grpo_advantages, grpo_advantages
from turnrl.types import Episode


def _as_float(values: Tensor | Sequence[float]) -> Tensor:
    return torch.as_tensor(values, dtype=torch.float32)


def discounted_returns(rewards: Tensor | Sequence[float], gamma: float) -> Tensor:
    """``R_t = sum_{k >= t} gamma^(k - t) r_k`` (GiGPO eq. 5). rewards ``[T]`` -> ``[T]``."""
    r = _as_float(rewards)
    returns = torch.zeros_like(r)
    running = 0.0
    for t in range(r.numel() - 1, -1, -1):
        running = float(r[t]) + gamma * running
        returns[t] = running
    return returns


# ---------------------------------------------------------------------------------------------
# GiGPO
# ---------------------------------------------------------------------------------------------

def anchor_group_ids(group_ids: Sequence[int], state_keys: Sequence[str]) -> Tensor:
    """Anchor-state group of each turn (GiGPO eq. 6). ``[N]`` ints, ``[N]`` strs -> ``[N]`` long.

    Turns share an anchor group when they were taken in the same episode group (same task and
    seed) and the same state, whichever episode they come from and however often one episode
    revisits the state. An empty state key is unknown: the turn gets a group of its own.
    """
    if len(group_ids) != len(state_keys):
        raise ValueError(f"{len(group_ids)} group ids but {len(state_keys)} state keys")
    ids: dict[tuple[int, str] | int, int] = {}
    out = []
    for n, (group, state) in enumerate(zip(group_ids, state_keys, strict=True)):
        key = (int(group), state) if state else n  # n is unique: a singleton group
        out.append(ids.setdefault(key, len(ids)))
    return torch.tensor(out, dtype=torch.long)


def episode_group_ids(episodes: Sequence[Episode]) -> Tensor:
    """The group of each episode for group-relative baselines: its ``group``, split by the
    role it played (``info["role"]``), so a self-play game's seats are compared only with
    the same seat of the other games of their group (GRPO per role; one role, as in every
    single-agent env, leaves the groups as they are). -> ``[N]`` long."""
    ids: dict[tuple[int, str], int] = {}
    return torch.tensor([ids.setdefault((ep.group, str(ep.info.get("role", ""))), len(ids))
                         for ep in episodes], dtype=torch.long)


def turn_anchor_ids(episodes: Sequence[Episode]) -> Tensor:
    """``anchor_group_ids`` of every turn of ``episodes``, flattened in episode then turn order.
    -> ``[sum of turns]`` long."""
    groups = [int(g) for ep, g in zip(episodes, episode_group_ids(episodes), strict=True)
              for _ in ep.turns]
    states = [turn.state for ep in episodes for turn in ep.turns]
    return anchor_group_ids(groups, states)


def _relative(values: Tensor, group_ids: Tensor, std_normalize: bool) -> Tensor:
    if values.numel() == 0:
        return values
    fn = grpo_advantages if std_normalize else dr_grpo_advantages
    return fn(values, group_ids)


def gigpo_step_advantages(step_returns: Tensor, anchor_ids: Tensor,
                          std_normalize: bool = True) -> Tensor:
    """Step-level relative advantage (GiGPO eq. 7): a turn's discounted return against the others
    of its anchor group; singleton groups get 0. ``[N], [N] -> [N]``."""
    return _relative(_as_float(step_returns), anchor_ids, std_normalize)


def anchor_fraction(anchor_ids: Tensor) -> float:
    """Fraction of turns whose anchor group holds more than one turn (so gets a step signal)."""
    if anchor_ids.numel() == 0:
        return 0.0
    _, inv, counts = torch.unique(anchor_ids, return_inverse=True, return_counts=True)
    return float((counts[inv] > 1).float().mean())


def gigpo_advantages(episodes: Sequence[Episode], gamma: float, step_weight: float = 1.0,
                     std_normalize: bool = True, episode_weight: float = 1.0) -> list[Tensor]:
    """GiGPO per-turn advantages ``A = A_E + step_weight * A_S`` (eq. 8), one ``[T_b]`` tensor
    per episode; ``episode_weight`` scales ``A_E`` (1 in the paper; 0 keeps the step-level,
    anchor-state term alone, so a turn whose anchor group all share one return gets nothing).

    ``A_E``: ``Episode.reward`` normalised within the episode group (``Episode.group``, eq. 3).
    ``A_S``: each turn's discounted return (``gamma``) from that turn on, normalised within its
    anchor group (``anchor_group_ids``).
    """
    returns = _as_float([ep.reward for ep in episodes])
    groups = episode_group_ids(episodes)
    episode_adv = _relative(returns, groups, std_normalize)
    step_returns = [discounted_returns([t.reward for t in ep.turns], gamma) for ep in episodes]
    flat = torch.cat(step_returns) if step_returns else torch.zeros(0)
    step_adv = gigpo_step_advantages(flat, turn_anchor_ids(episodes), std_normalize)
    per_episode = step_adv.split([len(ep.turns) for ep in episodes])
    return [episode_weight * episode_adv[b] + step_weight * steps
            for b, steps in enumerate(per_episode)]


# ---------------------------------------------------------------------------------------------
# Turn-level GAE
# ---------------------------------------------------------------------------------------------

def turn_gae(rewards: Tensor | Sequence[float], values: Tensor | Sequence[float], gamma: float,
             lam: float, *, done: bool = False) -> tuple[Tensor, Tensor]:
    """GAE over turns: ``delta_t = r_t + gamma V(s_{t+1}) - V(s_t)``,
    ``A_t = sum_k (gamma lam)^k delta_{t+k}``; returns ``(A [T], lambda-returns A + V [T])``.

    rewards ``[T]``: the turns' rewards. values ``[T+1]``: ``V(s_0) .. V(s_T)``, where ``s_T`` is
    the state after the last turn. ``done``: the episode terminated there, so ``V(s_T)`` is
    taken as 0; otherwise (truncated) the last turn bootstraps from ``values[T]``.
    """
    r, v = _as_float(rewards), _as_float(values)
    if v.shape != (r.numel() + 1,):
        raise ValueError(f"values must be [T+1] = [{r.numel() + 1}], got {tuple(v.shape)}")
    next_values = v[1:].clone()
    if done and r.numel():
        next_values[-1] = 0.0
    deltas = r + gamma * next_values - v[:-1]
    advantages = torch.zeros_like(r)
    running = 0.0
    for t in range(r.numel() - 1, -1, -1):
        running = float(deltas[t]) + gamma * lam * running
        advantages[t] = running
    return advantages, advantages + v[:-1]


def gae(rewards: Tensor | Sequence[float], values: Tensor | Sequence[float],
        discounts: Tensor | Sequence[float], lam: float, *, done: bool = False
        ) -> tuple[Tensor, Tensor]:
    """GAE with a discount per step: ``delta_i = r_i + d_i V_{i+1} - V_i``,
    ``A_i = delta_i + d_i lam A_{i+1}``; returns ``(A [N], lambda-returns A + V [N])``.

    rewards, discounts ``[N]``; values ``[N+1]`` (``V_N``: the state after the last step, taken
    as 0 when ``done``). With every discount ``gamma`` this is ``turn_gae``.
    """
    r, v, d = _as_float(rewards), _as_float(values), _as_float(discounts)
    if v.shape != (r.numel() + 1,) or d.shape != r.shape:
        raise ValueError(f"values must be [N+1] = [{r.numel() + 1}] and discounts [N] = "
                         f"[{r.numel()}], got {tuple(v.shape)} and {tuple(d.shape)}")
    next_values = v[1:].clone()
    if done and r.numel():
        next_values[-1] = 0.0
    deltas = (r + d * next_values - v[:-1]).tolist()
    steps, running = d.tolist(), 0.0
    advantages = [0.0] * len(deltas)
    for i in range(len(deltas) - 1, -1, -1):
        running = deltas[i] + steps[i] * lam * running
        advantages[i] = running
    out = torch.tensor(advantages, dtype=torch.float32)
    return out, out + v[:-1]


def token_steps(episode: Episode, gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    """An episode as token-level GAE steps: ``(positions [N] long, rewards [N], discounts [N])``.

    One step per policy token (``Turn.start:end`` of every turn), in order; ``positions`` are
    their indices in ``episode.token_ids``. A turn's reward sits on its last token and the
    discount to the next step is ``gamma`` there, 1 inside a turn. A turn with no token adds
    its reward to the step before it (none: dropped).
    """
    positions: list[int] = []
    rewards: list[float] = []
    discounts: list[float] = []
    for turn in episode.turns:
        if turn.end > turn.start:
            positions.extend(range(turn.start, turn.end))
            rewards.extend([0.0] * (turn.end - turn.start))
            discounts.extend([1.0] * (turn.end - turn.start))
            discounts[-1] = gamma
        if rewards:
            rewards[-1] += turn.reward
    return (torch.tensor(positions, dtype=torch.long), torch.tensor(rewards, dtype=torch.float32),
            torch.tensor(discounts, dtype=torch.float32))


def relative_fit_error(values: Tensor, returns: Tensor, eps: float = 1e-8) -> float:
    """Mean squared error of ``values`` against ``returns`` over the returns' variance: 1 minus
    the explained variance (0 = exact, 1 = no better than predicting the mean). ``[N], [N]``.
    All-equal returns make any error infinite (nothing to explain; a critic's noise is all it
    would add), and no turns at all give ``inf`` too."""
    v, g = _as_float(values), _as_float(returns)
    if g.numel() == 0:
        return math.inf
    mse, var = float((v - g).pow(2).mean()), float(g.var(unbiased=False))
    return mse / var if var > eps else (0.0 if mse <= eps else math.inf)


# ---------------------------------------------------------------------------------------------
# ArCHer
# ---------------------------------------------------------------------------------------------

def td_targets(rewards: Tensor, next_values: Tensor, dones: Tensor, gamma: float) -> Tensor:
    """Q's TD target ``r + gamma (1 - done) V_target(s')`` (ArCHer, utterance-level critic).
    ``[N], [N], [N] -> [N]``; ``dones`` is 1.0 where the episode ended after the turn."""
    return rewards + gamma * (1.0 - dones.float()) * next_values


def value_targets(target_q1: Tensor, target_q2: Tensor) -> Tensor:
    """V's target ``min(Q1_target, Q2_target)(s, a)`` on the action taken (see Departures).
    ``[N], [N] -> [N]``."""
    return torch.minimum(target_q1, target_q2)


def archer_advantages(q1: Tensor, q2: Tensor, values: Tensor) -> Tensor:
    """Turn-level advantage for the token policy, ``min(Q1, Q2)(s, a) - V(s)``.
    ``[N], [N], [N] -> [N]``."""
    return torch.minimum(q1, q2) - values


# ---------------------------------------------------------------------------------------------
# From turns to tokens
# ---------------------------------------------------------------------------------------------

def turn_to_token_advantages(episodes: Sequence[Episode],
                             per_turn_advantages: Sequence[Tensor | Sequence[float]],
                             width: int) -> Tensor:
    """Spread each turn's advantage over its sampled tokens ``start:end``; zero elsewhere.

    ``per_turn_advantages``: one ``[T_b]`` per episode. Returns ``[B, width]`` float32, aligned
    with ``Batch.input_ids`` (entry ``[b, t]`` applies to token ``t``).
    """
    if len(per_turn_advantages) != len(episodes):
        raise ValueError(f"{len(per_turn_advantages)} advantage rows for {len(episodes)} episodes")
    out = torch.zeros(len(episodes), width, dtype=torch.float32)
    for b, (ep, advantages) in enumerate(zip(episodes, per_turn_advantages, strict=True)):
        advantages = _as_float(advantages)
        if advantages.numel() != len(ep.turns):
            raise ValueError(f"episode {b} has {len(ep.turns)} turns but "
                             f"{advantages.numel()} advantages")
        for turn, value in zip(ep.turns, advantages.tolist(), strict=True):
            if turn.end > width:
                raise ValueError(f"episode {b} turn ends at token {turn.end} > width {width}")
            out[b, turn.start:turn.end] = value
    return out


def whiten_masked(values: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """``(x - mean) / (std + eps)`` over the entries where ``mask`` is set (sample std), zero
    elsewhere. ``[B, T], [B, T] -> [B, T]``."""
    where = mask.bool()
    picked = values[where]
    if picked.numel() == 0:
        return torch.zeros_like(values)
    std = picked.std() if picked.numel() > 1 else picked.new_zeros(())
    return torch.where(where, (values - picked.mean()) / (std + eps), torch.zeros_like(values))
