"""How much work a ``RaySource`` keeps in the system, from the rates it measures: the groups
to keep outstanding or buffered (``target``, capped by what the run's remaining steps can
train), each worker's pool of live episodes and the staleness bound. With ``pool.auto`` (the
default) a ``SizingController`` (sizing.py) decides them every step from ``MeasuredRates``
(rates.py); with ``staleness.adaptive`` the bound follows the effective sample size instead.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from turnrl.algorithms.offpolicy import AdaptiveStaleness
from turnrl.config import Config
from turnrl.devices import available_memory_bytes
from turnrl.distributed.book import in_flight_groups
from turnrl.distributed.rates import MeasuredRates
from turnrl.distributed.sizing import SizingController, kv_bytes_per_token, pool_memory_cap
from turnrl.distributed.workers import worker_pool_size
from turnrl.rollout.loop import Group
from turnrl.trainer.buffer import StalenessBuffer, group_staleness


class PoolSizing:
    """The target, the pools and the bound of one async run, and the rates they follow."""

    def __init__(self, cfg: Config, group_episodes: int,
                 adaptive: AdaptiveStaleness | None = None) -> None:
        self.cfg, self.adaptive = cfg, adaptive
        # In flight (the workers' pools) plus queued behind them, buffered groups included.
        self.target = in_flight_groups(cfg) + cfg.pool.queued_groups * cfg.ray.num_workers
        self.rates = MeasuredRates()
        self.group_episodes = group_episodes
        """Episodes a group holds (self-play: one per seat of each game); pools count these."""
        self.controller: SizingController | None = None
        if cfg.pool.auto:
            self.controller = SizingController.start(
                group_size=self.group_episodes, groups_per_step=cfg.rollout.groups_per_step,
                workers=cfg.ray.num_workers, bound=cfg.staleness.max_versions,
                pool=self.worker_pool(in_flight_groups(cfg)) * cfg.ray.num_workers,
                max_pool=1 << 20, ess_floor=cfg.staleness.ess_low,
                ess_high=cfg.staleness.ess_high)
        self.kv_bytes_per_token = 0.0
        self.step_clock: float | None = None
        self.arrived = 0

    @property
    def max_versions(self) -> int:
        """The staleness bound now."""
        if self.adaptive:
            return self.adaptive.max_versions
        return self.controller.bound.value if self.controller else self.cfg.staleness.max_versions

    def worker_pool(self, groups: int) -> int:
        """Live episodes a worker keeps for its share of ``groups``."""
        return worker_pool_size(self.cfg, groups, self.group_episodes)

    def wanted(self, version: int) -> int:
        """Groups to keep outstanding or buffered: ``target``, never more than the steps still
        to train need, the one being collected included (at most one step's groups more than
        needed while that step trains). Issued beyond this, a pool sized for a slow spell
        (Little's law over long tool calls) once handed out hundreds of groups for a run with
        56 left: one worker's burst then fed every step to the end, and the other worker's
        groups were abandoned (docs/cluster.md)."""
        steps_left = max(0, self.cfg.run.steps - version)
        return min(self.target, steps_left * self.cfg.rollout.groups_per_step)

    def note_model(self, model: torch.nn.Module) -> None:
        """The KV cache bytes per token of ``model`` (the pool's memory cap), once."""
        if not self.kv_bytes_per_token and hasattr(model, "config"):
            element = next(model.parameters()).element_size()
            self.kv_bytes_per_token = kv_bytes_per_token(model.config, element)

    def arrivals(self, groups: list[Group], version: int) -> None:
        """What arriving groups say about lifetimes, staleness and episode length."""
        episodes = [ep for g in groups for ep in g.episodes]
        self.arrived += len(groups)
        self.rates.observe_groups([g.finished_at - g.started_at for g in groups],
                                  [group_staleness(g, version) for g in groups],
                                  float(np.mean([len(ep.turns) for ep in episodes])),
                                  float(np.mean([len(ep.token_ids) for ep in episodes])))

    def after_step(self, update_metrics: dict[str, float], lost: int, in_system: int,
                   buffer: StalenessBuffer, version: int, fleet) -> dict[str, float]:
        """After a step: the adaptive bound's decision, the learner's rates, then
        (``pool.auto``) the new pool, queue and bound, applied to ``fleet``; as metrics.
        ``lost``: groups dropped or regenerated this step; ``in_system``: issued and not yet
        trained."""
        metrics = {}
        if self.adaptive is not None:  # the bound for the next step's groups
            decision = self.adaptive.update(update_metrics.get("offpolicy/ess", float("nan")))
            metrics.update(decision.metrics())
        now = time.perf_counter()
        step_s = now - (self.step_clock or now)
        self.step_clock = now
        self.rates.observe_step(step_s, buffer.waited,
                                update_metrics.get("offpolicy/ess", float("nan")))
        metrics.update(self.rates.metrics())
        if self.controller is None:
            return metrics
        cap = pool_memory_cap(self.kv_bytes_per_token, self.rates.tokens.value,
                              available_memory_bytes(), self.cfg.pool.memory_fraction)
        decision = self.controller.update(
            self.rates, self.arrived, lost, max_pool=cap, in_system=in_system,
            buffered=self.buffered_staleness(buffer.groups, version))
        self.arrived = 0
        self.apply(decision.pool, decision.queued_groups, fleet)
        return {**metrics, **decision.metrics(), "sizing/memory_cap": float(cap)}

    def buffered_staleness(self, groups: list[Group], version: int) -> list[int]:
        """The staleness each buffered group will have when trained: the buffer is used in
        arrival order, ``groups_per_step`` a step, from ``version`` on."""
        per_step = self.cfg.rollout.groups_per_step
        return [group_staleness(g, version + i // per_step) for i, g in enumerate(groups)]

    def presize(self, fleet) -> bool:
        """Before the first step: the pool for what the workers can generate (``presize``);
        whether it changed (the caller then tops up)."""
        before = self.controller.pool.value
        pool = self.controller.presize(self.rates)
        if pool is None or pool == before:
            return False
        self.apply(pool, self.controller.queued or self.cfg.pool.queued_groups, fleet)
        return True

    def apply(self, pool: int, queued_groups: int, fleet) -> None:
        """``pool`` live episodes in all and ``queued_groups`` per worker: the target, and
        each worker's pool (resized when it changed)."""
        groups = math.ceil(pool / self.group_episodes)
        self.target = (open_groups(pool, self.group_episodes, self.rates.live_per_group())
                       + queued_groups * self.cfg.ray.num_workers)
        size = self.worker_pool(groups)
        if size != fleet.pool_size:
            fleet.resize(size)


def open_groups(pool: int, group_size: int, live_per_group: float) -> int:
    """Groups to keep in play for ``pool`` live episodes. A group's ended episodes wait for
    its slowest one (heavy-tailed tools: the group lives ~2x its mean episode), so a group in
    play holds ``live_per_group`` live episodes, measured, not ``group_size``; issuing only
    ``pool / group_size`` groups would leave the workers' pools part empty."""
    if not math.isfinite(live_per_group):
        live_per_group = group_size
    return math.ceil(pool / min(max(live_per_group, 1.0), group_size))
