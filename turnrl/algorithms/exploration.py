"""Exploration and stability options: small pure functions, and the stage that applies them.

Each option is a config flag in the ``explore`` section (turnrl/config/explore.py), off by
default, and each is a pure function here with its paper; ``Exploration`` applies the ones
switched on inside the one ``rl_step`` (and the sync collector, for dynamic sampling and the
temperature schedule), and keeps what must survive a resume (``state_dict``).

Papers:
- Dynamic sampling, soft overlong punishment, overlong filtering: Yu et al. 2025, "DAPO"
  (arXiv:2503.14476), sec. 3.2 and 3.4, eq. 13.
- High-entropy minority tokens: Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy
  Minority Tokens Drive Effective Reinforcement Learning for LLM Reasoning"
  (arXiv:2506.01939): the policy-gradient term is kept only where the token's entropy is
  in the batch's top rho share; the normaliser stays the count of all tokens.
- Adaptive entropy coefficient: a bounded proportional-integral step on the coefficient
  towards a target entropy, as in SAC's automatic temperature (Haarnoja et al. 2018,
  arXiv:1812.05905, sec. 5) and "Skywork Open Reasoner 1" (He et al. 2025, arXiv:2505.22312,
  adaptive entropy control).
- Pass@k training: Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration
  and Exploitation of Large Reasoning Models" (arXiv:2508.10751), sec. 4, the analytical
  group advantages (eq. 11-14) for binary rewards.
- Count-based novelty: Tang et al. 2017, "#Exploration: A Study of Count-Based Exploration
  for Deep Reinforcement Learning" (arXiv:1611.04717), eq. 2: ``r + beta / sqrt(n(phi(s)))``
  with ``phi`` a hash; Bellemare et al. 2016 (arXiv:1606.01868) for pseudo-counts.

Departures:
- Overlong shaping counts an episode's policy tokens over all its turns (DAPO is single-turn:
  one reply); a single-turn task gets exactly DAPO's eq. 13.
- The novelty hash is exact (blake2b of the state text: the env's ``state_key`` when it gives
  one, else the observation the policy answered), not SimHash: text states are discrete.
  A turn's bonus counts the state it acted in; counts include the current batch (a state
  first seen now gets ``beta``), so every turn's bonus lies in ``(0, beta]``.
- Pass@k advantages use episode success as the binary reward.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import torch
from torch import Tensor

from turnrl.algorithms.advantages import _group_sum
from turnrl.algorithms.credit import episode_group_ids
from turnrl.config import ExploreConfig
from turnrl.types import Episode

# ---- dynamic sampling (DAPO) ----------------------------------------------------------------


def informative_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """``[N] bool``: the sample's group has rewards that are not all equal (a non-zero
    group-relative advantage is possible). ``[N], [N] -> [N]``."""
    r = rewards.float()
    _, inv = torch.unique(group_ids, return_inverse=True)
    groups = int(inv.max()) + 1 if inv.numel() else 0
    high = torch.full((groups,), -math.inf).scatter_reduce(0, inv, r, "amax")
    low = torch.full((groups,), math.inf).scatter_reduce(0, inv, r, "amin")
    return (high > low)[inv]


def _groups_of(episodes: Sequence[Episode]) -> list[list[Episode]]:
    by_group: dict[int, list[Episode]] = {}
    for ep in episodes:
        by_group.setdefault(ep.group, []).append(ep)
    return list(by_group.values())


def group_has_signal(group: Sequence[Episode]) -> bool:
    """Whether a group's rewards differ (a self-play group holds every seat: whether one
    role's rewards differ)."""
    rewards = torch.tensor([ep.reward for ep in group])
    return bool(informative_groups(rewards, episode_group_ids(group)).any())


G = TypeVar("G")


def informative_rounds(first: list[G], more: Callable[[int, int], list[G]], groups_needed: int,
                       max_rounds: int, episodes: Callable[[G], Sequence[Episode]]
                       ) -> tuple[list[G], list[G], dict[str, float]]:
    """DAPO dynamic sampling over groups of any kind (``episodes(group)`` reads one): keep the
    groups with a signal, ask ``more(round, missing)`` (round 1, 2, ...) for more until
    ``groups_needed`` are kept or ``max_rounds`` extra rounds were taken. Returns the groups
    to train on (at most ``groups_needed``; ``first`` whole when none has a signal), the
    groups left out, and the ``dynamic/*`` metrics."""
    kept: list[G] = []
    left: list[G] = []
    rounds = 0
    batch = first
    while True:
        for group in batch:
            (kept if group_has_signal(episodes(group)) else left).append(group)
        if len(kept) >= groups_needed or rounds >= max_rounds:
            break
        rounds += 1
        batch = more(rounds, groups_needed - len(kept))
    metrics = {"dynamic/rounds": float(rounds), "dynamic/dropped_groups": float(len(left)),
               "dynamic/collected_groups": float(len(kept) + len(left)),
               "dynamic/kept_groups": float(min(len(kept), groups_needed))}
    if not kept:
        firsts = {id(group) for group in first}
        return first, [group for group in left if id(group) not in firsts], metrics
    return kept[:groups_needed], left + kept[groups_needed:], metrics


def dynamic_sampling(first: list[Episode], collect_round: Callable[[int], list[Episode]],
                     groups_needed: int, max_rounds: int) -> tuple[list[Episode], dict]:
    """DAPO dynamic sampling on the sync collector's episodes (``informative_rounds``):
    ``collect_round(round)`` plays a whole round of fresh groups. Returns the episodes to train
    on and metrics. Group ids must be unique across rounds (the caller numbers them)."""
    groups, _, metrics = informative_rounds(
        _groups_of(first), lambda round_, _: _groups_of(collect_round(round_)), groups_needed,
        max_rounds, lambda group: group)
    return [ep for group in groups for ep in group], metrics


# ---- overlong shaping and truncation (DAPO) ------------------------------------------------


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, penalty: float = 1.0
                     ) -> Tensor:
    """DAPO soft overlong punishment (eq. 13), scaled by ``penalty``: 0 up to
    ``max_tokens - buffer`` tokens, then falling linearly to ``-penalty`` at ``max_tokens``,
    ``-penalty`` beyond. ``[N] -> [N]`` (<= 0)."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_tokens - buffer)) / buffer
    return -penalty * over.clamp(0.0, 1.0)


def is_truncated(episode: Episode) -> bool:
    """The episode was cut, not finished: out of turns or context, or its last reply stopped at
    ``max_new_tokens`` (DAPO's "truncated samples")."""
    cut_reply = bool(episode.turns) and episode.turns[-1].finish_reason == "length"
    return episode.status == "truncated" or (cut_reply and episode.status != "done")


# ---- high-entropy minority tokens (Wang et al. 2025) ---------------------------------------


def entropy_threshold(entropies: Tensor, fraction: float) -> float:
    """The entropy at or above which the top ``fraction`` of the given token entropies lie.
    ``[N]`` (policy tokens only) -> float; ``-inf`` when everything is kept."""
    if fraction >= 1 or entropies.numel() == 0:
        return -math.inf
    keep = max(1, math.ceil(fraction * entropies.numel()))
    return float(torch.topk(entropies.flatten().float(), keep).values[-1])


def high_entropy_mask(entropies: Tensor, mask: Tensor, fraction: float,
                      threshold: float | None = None) -> Tensor:
    """``[B,T] bool``: policy tokens (``mask``) whose entropy is in the top ``fraction``; the
    threshold is computed over ``mask``'s tokens unless given (a whole batch's, when the
    caller splits it into micro-batches). ``[B,T], [B,T] -> [B,T]``."""
    keep = mask.bool()
    if threshold is None:
        threshold = entropy_threshold(entropies[keep], fraction)
    return keep & (entropies >= threshold)


# ---- adaptive entropy bonus, temperature schedule, advantage weighting ---------------------


def adaptive_entropy_coef(coef: float, entropy: float, target: float, rate: float,
                          coef_max: float) -> float:
    """One controller step: raise the bonus when entropy is below ``target``, lower it above,
    kept in ``[0, coef_max]`` (the bound keeps a far-off target from blowing it up)."""
    return min(coef_max, max(0.0, coef + rate * (target - entropy)))


def scheduled_temperature(step: int, steps: int, start: float, end: float, kind: str) -> float:
    """Sampling temperature at ``step`` of ``steps`` (0-based): ``constant`` keeps ``start``;
    ``linear`` and ``cosine`` go from ``start`` at step 0 to ``end`` at the last step."""
    if kind == "constant" or steps <= 1:
        return start
    progress = min(1.0, max(0.0, step / (steps - 1)))
    if kind == "linear":
        return start + (end - start) * progress
    if kind == "cosine":
        return end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown temperature schedule {kind!r}; valid: constant, linear, cosine")


def weight_advantages(advantages: Tensor, positive: float, negative: float) -> Tensor:
    """Positive advantages times ``positive``, negative ones times ``negative``; any shape."""
    return torch.where(advantages > 0, advantages * positive, advantages * negative)


# ---- pass@k training (Chen et al. 2025) ----------------------------------------------------


def _comb_ratio(a: Tensor, b: Tensor, k: int) -> Tensor:
    """``C(a, k) / C(b, k)`` elementwise for ``0 <= a <= b`` (0 when ``a < k``), computed as
    ``prod_{i<k} (a - i) / (b - i)`` so no factorial overflows."""
    ratio = torch.ones_like(a, dtype=torch.float64)
    for i in range(k):
        ratio = ratio * ((a - i).clamp(min=0) / (b - i).clamp(min=1))
    return ratio.float()


def passk_advantages(correct: Tensor, group_ids: Tensor, k: int, eps: float = 1e-6) -> Tensor:
    """Analytic pass@k group advantages (Chen et al. 2025, sec. 4.3). For a group of ``n``
    samples with ``n_neg`` failures: the group's pass@k ``R = 1 - C(n_neg, k) / C(n, k)``,
    ``sigma = sqrt(R (1 - R))``; a success gets ``(1 - R) / sigma``, a failure
    ``(1 - R - C(n_neg - 1, k - 1) / C(n - 1, k - 1)) / sigma``. All-equal groups get 0.
    k = 1 gives GRPO's advantages with the population std. correct ``[N]`` bool, group_ids
    ``[N]`` -> ``[N]``."""
    if k < 1:
        raise ValueError(f"pass@k training needs k >= 1, got {k}")
    c = correct.float()
    sums, counts, inv = _group_sum(c, group_ids)
    n, n_neg = counts[inv].double(), (counts - sums)[inv].double()
    if bool((n < k).any()):
        raise ValueError(f"pass@{k} training needs groups of at least {k} samples, got "
                         f"{int(n.min())}; lower explore.pass_k or raise rollout.group_size")
    group_pass = 1 - _comb_ratio(n_neg, n, k)
    sigma = (group_pass * (1 - group_pass)).sqrt()
    # Every k-subset holding this failure passes only if its other k - 1 members do.
    fail_miss = _comb_ratio(n_neg - 1, n - 1, k - 1) if k > 1 else torch.ones_like(group_pass)
    adv = torch.where(correct.bool(), 1 - group_pass, 1 - group_pass - fail_miss)
    return torch.where(sigma > eps, adv / sigma.clamp(min=eps), torch.zeros_like(adv))


# ---- count-based state novelty (Tang et al. 2017) ------------------------------------------


def state_hash(text: str) -> str:
    """A short stable hash of an environment state's text."""
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class NoveltyCounts:
    """Visit counts of hashed environment states over training; ``beta / sqrt(N(s))``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def bonuses(self, episodes: Sequence[Episode], beta: float) -> list[list[float]]:
        """Count every turn's state in ``episodes``, then each turn's bonus (counts include
        this batch)."""
        keys = [[state_hash(turn.state or turn.observation) for turn in ep.turns]
                for ep in episodes]
        for row in keys:
            for key in row:
                self.counts[key] = self.counts.get(key, 0) + 1
        return [[beta / math.sqrt(self.counts[key]) for key in row] for row in keys]

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = dict(state.get("counts", {}))


# ---- stability guard -------------------------------------------------------------------------


class StabilityGuard:
    """Flags an entropy collapse (below ``entropy_fraction`` of the first step's entropy) and
    an extreme clip fraction (above ``clip_fraction``), each once it held ``patience``
    consecutive steps; the flags go into the metrics as ``warn/*`` (1 while it holds)."""

    def __init__(self, entropy_fraction: float, clip_fraction: float, patience: int) -> None:
        self.entropy_fraction, self.clip_fraction = entropy_fraction, clip_fraction
        self.patience = patience
        self.start_entropy: float | None = None
        self.streaks = {"entropy_collapse": 0, "clip_extreme": 0}
        self.announced: set[str] = set()

    def update(self, entropy: float | None, clip_fraction: float | None) -> dict[str, float]:
        if entropy is not None and self.start_entropy is None:
            self.start_entropy = entropy
        low = (entropy is not None and self.start_entropy is not None
               and entropy < self.entropy_fraction * self.start_entropy)
        high = clip_fraction is not None and clip_fraction > self.clip_fraction
        out = {}
        for name, now in (("entropy_collapse", low), ("clip_extreme", high)):
            self.streaks[name] = self.streaks[name] + 1 if now else 0
            firing = self.streaks[name] >= self.patience
            out[f"warn/{name}"] = float(firing)
            if firing and name not in self.announced:
                self.announced.add(name)
                warnings.warn(self._message(name, entropy, clip_fraction), stacklevel=2)
        return out

    def _message(self, name: str, entropy: float | None, clip: float | None) -> str:
        if name == "entropy_collapse":
            return (f"entropy collapse: {entropy:.3g} nats/token is below "
                    f"{self.entropy_fraction:g} x the start ({self.start_entropy:.3g}) for "
                    f"{self.patience} steps; lower optim.lr or try explore.entropy_target")
        return (f"clip fraction {clip:.3g} above {self.clip_fraction:g} for {self.patience} "
                "steps: updates move the policy too far; lower optim.lr")

    def state_dict(self) -> dict:
        return {"start_entropy": self.start_entropy, "streaks": dict(self.streaks)}

    def load_state_dict(self, state: dict) -> None:
        self.start_entropy = state.get("start_entropy")
        self.streaks.update(state.get("streaks", {}))


# ---- the stage ---------------------------------------------------------------------------


class Exploration:
    """Applies the ``explore`` options inside ``rl_step``; one per learner.

    ``step`` counts the RL steps taken (restored on resume), for the temperature schedule.
    """

    def __init__(self, cfg: ExploreConfig, *, steps: int, temperature: float,
                 entropy_coef: float, max_policy_tokens: int) -> None:
        self.cfg, self.steps, self.base_temperature = cfg, steps, temperature
        self.entropy_coef = entropy_coef
        self.max_policy_tokens = cfg.overlong_max_tokens or max_policy_tokens
        self.step = 0
        self.novelty = NoveltyCounts()
        self.guard = StabilityGuard(cfg.warn_entropy_fraction, cfg.warn_clip_fraction,
                                    cfg.warn_patience)
        self._metrics: dict[str, float] = {}

    def temperature(self, step: int | None = None) -> float:
        """Sampling (and scoring) temperature of ``step`` (default: the current one)."""
        c = self.cfg
        return scheduled_temperature(self.step if step is None else step, self.steps,
                                     self.base_temperature, c.temperature_end,
                                     c.temperature_schedule)

    def shaped(self, episodes: Sequence[Episode]) -> list[Episode]:
        """Copies of ``episodes`` with the novelty bonus (per turn) and the overlong penalty
        in their rewards, for the estimator; the originals (logged) are left as they were."""
        c, self._metrics = self.cfg, {}
        if not c.novelty_coef and not c.overlong_buffer:
            return list(episodes)
        bonuses = (self.novelty.bonuses(episodes, c.novelty_coef) if c.novelty_coef
                   else [[0.0] * len(ep.turns) for ep in episodes])
        lengths = torch.tensor([ep.num_policy_tokens for ep in episodes])
        penalty = overlong_penalty(lengths, self.max_policy_tokens, c.overlong_buffer,
                                   c.overlong_penalty).tolist()
        out = []
        for ep, bonus, pen in zip(episodes, bonuses, penalty, strict=True):
            turns = [replace(t, reward=t.reward + b) for t, b in zip(ep.turns, bonus,
                                                                      strict=True)]
            if turns:  # the overlong penalty lands on the last turn (it ends the episode)
                turns[-1] = replace(turns[-1], reward=turns[-1].reward + pen)
            out.append(replace(ep, turns=turns, reward=ep.reward + sum(bonus) + pen))
        n = max(len(episodes), 1)
        if c.novelty_coef:
            self._metrics["explore/novelty_bonus"] = sum(map(sum, bonuses)) / n
            self._metrics["explore/novel_states"] = float(len(self.novelty.counts))
        if c.overlong_buffer:
            self._metrics["explore/overlong_penalty"] = sum(penalty) / n
        return out

    def advantages(self, episodes: Sequence[Episode], advantages: Tensor) -> Tensor:
        """Pass@k group advantages (when on) and positive/negative weights."""
        c = self.cfg
        if c.pass_k:
            if advantages.dim() != 1:
                raise ValueError("explore.pass_k needs an episode-level algo.advantage (one "
                                 "advantage per episode)")
            advantages = passk_advantages(torch.tensor([ep.success for ep in episodes]),
                                          episode_group_ids(episodes), c.pass_k)
        if c.positive_weight != 1 or c.negative_weight != 1:
            advantages = weight_advantages(advantages, c.positive_weight, c.negative_weight)
        return advantages

    def loss_mask(self, episodes: Sequence[Episode], loss_mask: Tensor) -> Tensor:
        """``loss_mask`` with the truncated episodes' rows zeroed (``mask_truncated``)."""
        if not self.cfg.mask_truncated:
            return loss_mask
        cut = torch.tensor([is_truncated(ep) for ep in episodes])
        self._metrics["explore/truncated_masked"] = float(cut.float().mean())
        return loss_mask.masked_fill(cut[:, None], 0.0)

    def end_step(self, update: dict[str, float]) -> dict[str, float]:
        """Adapt the entropy coefficient, check the guards, advance the step; the metrics."""
        c, metrics = self.cfg, dict(self._metrics)
        entropy = update.get("entropy")
        if c.entropy_target and entropy is not None:
            metrics["explore/entropy_coef"] = self.entropy_coef
            self.entropy_coef = adaptive_entropy_coef(self.entropy_coef, entropy,
                                                      c.entropy_target, c.entropy_coef_rate,
                                                      c.entropy_coef_max)
        if c.temperature_schedule != "constant":
            metrics["explore/temperature"] = self.temperature()
        metrics.update(self.guard.update(entropy, update.get("clip_fraction")))
        self.step += 1
        return metrics

    def state_dict(self) -> dict:
        return {"step": self.step, "entropy_coef": self.entropy_coef,
                "novelty": self.novelty.state_dict(), "guard": self.guard.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state.get("step", self.step)
        self.entropy_coef = state.get("entropy_coef", self.entropy_coef)
        self.novelty.load_state_dict(state.get("novelty", {}))
        self.guard.load_state_dict(state.get("guard", {}))
