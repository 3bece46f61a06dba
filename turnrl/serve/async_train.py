"""Continuous training through the endpoint: agents keep playing while the learner trains.

``train_agent`` with ``serve.train_mode async`` runs the repo's asynchronous learner
(``turnrl.trainer.async_.learn``: the one ``rl_step``, decoupled PPO always on) over a
``ServedSource``, the ``RolloutSource`` of agent code playing a live server:

- a background thread keeps ``serve.groups_in_flight`` task groups playing (``group_size``
  runs of the user's ``rollout`` per task, each run one recorded episode, scored as in sync
  mode by ``train.collect``); a group is delivered when all its runs have ended;
- the server samples with its own copy of the weights, so generation goes on while the
  learner computes its update; ``publish`` copies the learner's weights in under the
  server's weights lock (between generate calls) and bumps the served version, which every
  recorded token carries;
- ``collect`` hands the learner the first complete groups whose oldest policy token is at
  most ``staleness.max_versions`` versions behind (``split_stale``, as the Ray source does);
  older ones are dropped and counted (``async/dropped_groups``, ``AsyncTrainResult.dropped``);
- the update corrects for the lag with the recorded behaviour log-probabilities (decoupled
  PPO: Hilton et al. 2022, "Batch size-invariance for policy optimization", arXiv:2110.00641;
  as AReaL, Fu et al. 2025, arXiv:2505.24298).

Not here: ``staleness.on_stale regenerate`` (a stale group is dropped; its task is not
replayed), the rate-driven pool sizing of ``pool.auto`` (``groups_in_flight`` is fixed),
resuming (``resume`` is refused in async mode).
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from turnrl.algorithms.offpolicy import staleness
from turnrl.config import Config
from turnrl.distributed.book import group_staleness, split_stale
from turnrl.models import configure_torch
from turnrl.policy import load_policy
from turnrl.rollout.loop import Group
from turnrl.serve.app import RunningServer
from turnrl.serve.server import Server
from turnrl.serve.train import (
    AgentTrainResult,
    PerEpisodeAdvantages,
    collect,
    evaluate_agent,
    self_judge,
    summarize_agent,
)
from turnrl.trainer.async_ import learn

STALL_AFTER_S = 900.0
"""No complete group for this long ends the run with an error instead of hanging."""


class ServedSource:
    """``RolloutSource`` over agent code playing ``server`` (see the module docstring)."""

    def __init__(self, server: Server, base_url: str, rollout, tasks: Sequence, cfg: Config,
                 judge=None):
        self.server, self.base_url, self.rollout, self.tasks = server, base_url, rollout, tasks
        self.cfg, self.judge = cfg, judge
        self.max_versions = cfg.staleness.max_versions
        self.in_flight = cfg.serve.groups_in_flight or 2 * cfg.rollout.groups_per_step
        self.version = server.engine.version
        self.arrivals: queue.Queue[Group] = queue.Queue()
        self.buffer: list[Group] = []
        self.next_assignment = 0
        self.issued: dict[int, int] = {}
        self.trained: list[tuple[int, int]] = []
        self.trained_staleness: list[int] = []
        """Versions behind the learner of each trained group, when it was trained."""
        self.dropped: list[int] = []
        self.step_dropped = 0
        self.left_out: list[dict] = []
        self.waited = 0.0
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._play, name="turnrl-agents", daemon=True)

    # ---- the RolloutSource interface ---------------------------------------------------------

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """Copy the learner's weights into the served model (between generate calls)."""
        with self.server.weights_lock, torch.no_grad():
            served = self.server.model
            if served is not model:
                for mine, theirs in zip(served.parameters(), model.parameters(), strict=True):
                    mine.copy_(theirs)
            self.server.engine.version = version
        self.version = version

    def wait_ready(self) -> None:
        if not self.thread.is_alive():
            self.thread.start()

    def collect(self, need: int) -> list[Group]:
        """The first ``need`` complete groups at most ``max_versions`` behind (arrival order)."""
        self.waited = 0.0
        last_arrival = time.monotonic()
        while True:
            while not self.arrivals.empty():
                self.buffer.append(self.arrivals.get_nowait())
                last_arrival = time.monotonic()
            self.buffer, stale = split_stale(self.buffer, self.version, self.max_versions)
            self.dropped += [group.assignment for group in stale]
            self.step_dropped += len(stale)
            if len(self.buffer) >= need:
                groups, self.buffer = self.buffer[:need], self.buffer[need:]
                return groups
            if self.error is not None:
                raise RuntimeError(f"the agents' loop failed: {self.error}") from self.error
            if time.monotonic() - last_arrival > STALL_AFTER_S:
                raise RuntimeError(f"no complete group arrived for {STALL_AFTER_S:.0f} s; "
                                   "are the agents calling the server?")
            started = time.perf_counter()
            try:
                self.buffer.append(self.arrivals.get(timeout=1.0))
                last_arrival = time.monotonic()
            except queue.Empty:
                pass
            self.waited += time.perf_counter() - started

    def step_metrics(self, step: int, groups: list[Group],
                     update_metrics: dict[str, float]) -> dict[str, float]:
        episodes = [ep for g in groups for ep in g.episodes]
        behind = [group_staleness(g, step) for g in groups]
        self.trained += [(g.assignment, g.seed) for g in groups]
        self.trained_staleness += behind
        metrics = {
            "async/staleness_mean": float(np.mean([staleness(ep.versions, step)
                                                   for ep in episodes])),
            "async/staleness_max": max(behind),
            "async/group_lifetime_s": float(np.mean([g.finished_at - g.started_at
                                                     for g in groups])),
            "async/mixed_version_episodes": float(np.mean(
                [len(set(ep.versions) - {-1}) > 1 for ep in episodes])),
            "async/dropped_groups": float(self.step_dropped),
            "async/buffered_groups": float(len(self.buffer) + self.arrivals.qsize()),
            "async/max_versions": float(self.max_versions),
            "episode/left_out": float(sum(x["step"] == step for x in self.left_out)),
            "episode/segments": float(len(episodes)),
            "time/wait_s": self.waited,
        }
        self.step_dropped = 0
        return metrics

    def state_dict(self) -> dict:
        return {"next_assignment": self.next_assignment}

    def close(self) -> dict:
        """Stop the agents (runs in flight are cancelled); the books' totals."""
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=60)
        trained = {a for a, _ in self.trained}
        abandoned = sorted(a for a in self.issued if a not in trained and a not in self.dropped)
        return {"trained": list(self.trained), "dropped": list(self.dropped),
                "regenerated": [], "reissued": [], "abandoned": abandoned, "duplicates": 0,
                "worker_restarts": 0, "issued": dict(self.issued)}

    # ---- the agents' loop (its own thread and event loop) -----------------------------------

    def _play(self) -> None:
        try:
            asyncio.run(self._keep_playing())
        except BaseException as err:  # noqa: BLE001 - reported by collect, not lost in a thread
            self.error = err

    async def _keep_playing(self) -> None:
        running: set[asyncio.Task] = set()
        while not self.stop.is_set():
            while len(running) < self.in_flight:
                running.add(asyncio.create_task(self._group(self.next_assignment)))
                self.next_assignment += 1
            done, running = await asyncio.wait(running, timeout=0.2,
                                               return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                group = task.result()
                if group is not None:
                    self.arrivals.put(group)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    async def _group(self, assignment: int) -> Group | None:
        """Play one task ``group_size`` times; the scored group (None: nothing trainable).
        Its left-out episodes are booked under the version the group started at."""
        index = assignment % len(self.tasks)
        self.issued[assignment] = index
        started = time.perf_counter()
        episodes, left_out = await collect(
            self.server, self.base_url, self.rollout, [self.tasks[index]],
            self.cfg.rollout.group_size, self.version, self.cfg.rollout.temperature,
            self.judge, first_group=assignment)
        self.left_out += left_out
        if not episodes:
            return None
        return Group(assignment, index, episodes, started_at=started,
                     finished_at=time.perf_counter())


def async_config(cfg: Config) -> Config:
    """The learner's config: held-out evaluation is the agent's own (``eval_tasks``), not an
    environment's, so the env evaluation of ``learn`` is off (``staleness.on_stale`` drop is
    checked with the config: ``turnrl.config.checks.check_serve_training``)."""
    return replace(cfg, eval=replace(cfg.eval, episodes=0, every=0))


def train_agent_async(rollout, tasks: Sequence, cfg: Config, *, eval_tasks: Sequence = (),
                      success_at: float = 1.0, judge=None) -> AgentTrainResult:
    """``train_agent`` in async mode (same arguments; see the module docstring)."""
    learner_cfg = async_config(cfg)  # checked before anything starts
    configure_torch(cfg.run.threads)
    served = load_policy(cfg)  # the server's own copy: it samples while the learner updates
    server = Server.from_policy(served, cfg)
    sources: list[ServedSource] = []

    def make_source(learner_cfg: Config, run_dir, state: dict, start_step: int) -> ServedSource:
        sources.append(ServedSource(server, running.base_url, rollout, tasks, learner_cfg,
                                    judge))
        return sources[-1]

    per_episode = lambda learner: replace(  # noqa: E731 - segments share their advantage
        learner, estimator=PerEpisodeAdvantages(learner.estimator))
    with RunningServer(server, cfg.serve.host, cfg.serve.port) as running:
        print(f"serving the policy at {running.base_url} while training (async, at most "
              f"{cfg.staleness.max_versions} versions behind)")
        if judge == "self":
            judge = self_judge(running.base_url, server.name, cfg.serve.api_key)
        before = (asyncio.run(evaluate_agent(rollout, eval_tasks, running.base_url,
                                             cfg.serve.api_key, success_at))
                  if eval_tasks else None)
        trained = learn(learner_cfg, make_source, adapt_learner=per_episode)
        after = (asyncio.run(evaluate_agent(rollout, eval_tasks, running.base_url,
                                            cfg.serve.api_key, success_at))
                 if eval_tasks else None)
    source = sources[0]
    result = AgentTrainResult(trained.run_dir, left_out=source.left_out, before=before,
                              after=after, staleness=source.trained_staleness,
                              dropped=trained.dropped)
    result.rewards = [m["reward/mean"] for m in read_metrics(trained.run_dir)]
    if result.dropped:
        print(f"{len(result.dropped)} groups dropped as more than "
              f"{cfg.staleness.max_versions} versions behind")
    return summarize_agent(result, eval_tasks, cfg.run.steps)


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
