"""``ServedSource``: agent code playing a live ``turnrl serve`` as the learner's rollout source.

``train_agent(rollout, tasks, cfg)`` runs the one learner loop (``turnrl.trainer.learn``) over
this source. The policy is served at ``serve.host:serve.port`` for the whole run; each run of
the user's ``rollout`` is recorded as one episode (serve/agents.py) and scored by the reward it
returns. ``run.mode`` picks how episodes arrive:

- ``sync``: each step plays ``group_size`` runs of each of ``groups_per_step`` tasks (taken in
  turn) at once against the learner's own weights (the server batches their calls), then the
  update runs under the server's weights lock (no request sees half an update): on-policy.
- ``async``: a background thread keeps ``serve.groups_in_flight`` task groups playing against
  the server's own copy of the weights, so agents keep playing while the learner trains;
  ``publish`` copies the new weights in between generate calls. Finished groups wait in the
  staleness buffer (trainer/buffer.py); groups more than ``staleness.max_versions`` behind
  are dropped and counted (a stale task is not replayed). The update corrects for the lag
  with the recorded behaviour log-probabilities (decoupled PPO: Hilton et al. 2022,
  arXiv:2110.00641, as AReaL, Fu et al. 2025, arXiv:2505.24298). Not here: resuming, and the
  rate-driven pool sizing of the Ray source (``groups_in_flight`` is fixed).

An episode the agent did not score (it raised, returned None, or sampled at another
temperature than ``rollout.temperature``) is left out of training with its reason.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace

import torch

from turnrl.config import Config, ConfigError
from turnrl.evaluation import EvalResult
from turnrl.policy import load_policy, publish
from turnrl.registry import ESTIMATORS, estimator_level
from turnrl.rollout.loop import Group
from turnrl.serve.agents import Judge, Rollout, evaluate_agent, play_groups, self_judge
from turnrl.serve.app import RunningServer
from turnrl.serve.server import Server
from turnrl.trainer.bookkeeping import TrainResult
from turnrl.trainer.buffer import StalenessBuffer, group_staleness
from turnrl.trainer.learn import SourceDefaults
from turnrl.trainer.run import Run
from turnrl.types import Episode


@dataclass
class AgentTrainResult(TrainResult):
    rewards: list[float] = field(default_factory=list)
    """Mean reward of the trained episodes, per step."""
    left_out: list[dict] = field(default_factory=list)
    """Episodes not trained on: {"step", "episode_id", "reason"}."""
    staleness: list[int] = field(default_factory=list)
    """Async mode: how many versions behind the learner each trained group was."""
    dropped: list[int] = field(default_factory=list)
    """Async mode: the groups dropped as older than ``staleness.max_versions``."""


class PerEpisodeAdvantages:
    """An outcome-level estimator applied once per recorded episode, its advantage copied to
    every segment of it (an episode split into k segments must not weigh k times in its
    group's mean and spread)."""

    def __init__(self, inner):
        self.inner = inner

    def advantages(self, segments: list[Episode], model, pad_id: int) -> torch.Tensor:
        owners: dict[str, int] = {}
        index = [owners.setdefault(s.info["episode_id"], len(owners)) for s in segments]
        firsts = {}
        for s, i in zip(segments, index, strict=True):
            firsts.setdefault(i, s)
        values = self.inner.advantages([firsts[i] for i in range(len(owners))], model, pad_id)
        return values[torch.tensor(index)]

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def served_config(cfg: Config) -> Config:
    """The learner's config: held-out evaluation is the agent's own (``eval_tasks``), not an
    environment's, so the env evaluation is off."""
    return replace(cfg, eval=replace(cfg.eval, episodes=0, every=0))


class ServedSource(SourceDefaults):
    """Episodes of ``rollout`` over ``tasks`` played against a live server (module docstring).
    ``judge`` ("self": the served policy, or a ``Judge``) scores the episodes whose rollout
    returns None; ``eval_tasks`` are played before and after training (success: a reward of at
    least ``success_at``)."""

    def __init__(self, rollout: Rollout, tasks: Sequence, cfg: Config, *,
                 eval_tasks: Sequence = (), success_at: float = 1.0,
                 judge: Judge | str | None = None) -> None:
        if not tasks:
            raise ConfigError("train_agent needs at least one task")
        if cfg.env.curriculum or cfg.env.mix:
            raise ConfigError("env.curriculum and env.mix choose the envs turnrl train plays; "
                              "train_agent plays its own tasks: drop them")
        if (level := estimator_level(cfg.algo.advantage)) != "episode":
            episode_level = [n for n, e in ESTIMATORS.items() if e.level == "episode"]
            raise ConfigError(f"train_agent needs an episode-level algo.advantage "
                              f"({', '.join(episode_level)}); {cfg.algo.advantage} is "
                              f"{level}-level, and recorded episodes carry no env states or "
                              "turns for its credit")
        self.off_policy = cfg.run.mode == "async"
        if self.off_policy and cfg.staleness.on_stale != "drop":
            raise ConfigError("train_agent in run.mode async drops stale groups (their tasks "
                              "are not replayed); pass --staleness.on_stale drop")
        self.rollout, self.tasks, self.eval_tasks = rollout, tasks, eval_tasks
        self.success_at, self.judge = success_at, judge
        self.buffer = StalenessBuffer("are the agents calling the server?")
        self.arrivals: queue.Queue[Group] = queue.Queue()
        self.taken: list[Group] = []
        self.next_assignment = 0
        self.issued: dict[int, int] = {}
        self.rewards: list[float] = []
        self.left_out: list[dict] = []
        self.trained_staleness: list[int] = []
        """Versions behind the learner of each trained group, when it was trained."""
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._play, name="turnrl-agents", daemon=True)
        self.running: RunningServer | None = None

    def open(self, run: Run) -> None:
        """Serve the policy (in async mode its own copy: it samples while the learner
        updates); segments of one recorded episode share its advantage."""
        cfg = self.cfg = run.cfg
        served = load_policy(cfg, who="server") if self.off_policy else run.policy
        if not self.off_policy:  # one model, one sampler: what it serves is what it trains
            print("sampler: the learner's own (server)", flush=True)
        self.server = Server.from_policy(served, cfg)
        self.version = self.server.engine.version
        self.running = RunningServer(self.server, cfg.serve.host, cfg.serve.port)
        self.base_url = self.running.__enter__().base_url
        mode = (f"async, at most {cfg.staleness.max_versions} versions behind"
                if self.off_policy else "sync")
        print(f"serving the policy at {self.base_url} while training ({mode})")
        if self.judge == "self":
            self.judge = self_judge(self.base_url, self.server.name, cfg.serve.api_key)
        self.in_flight = cfg.serve.groups_in_flight or 2 * cfg.rollout.groups_per_step
        run.learner = replace(run.learner, estimator=PerEpisodeAdvantages(run.learner.estimator))

    def label(self, cfg: Config) -> str:
        return "agent (async)" if self.off_policy else "agent"

    def held_out(self, cfg: Config) -> str:
        return f"agent: {len(self.eval_tasks)} held-out tasks"

    def evaluate(self, run: Run, when: str) -> EvalResult | None:
        if not self.eval_tasks:
            return None
        if when == "after":
            self._stop_agents()  # the evaluation plays against the same server
        return asyncio.run(evaluate_agent(self.rollout, self.eval_tasks, self.base_url,
                                          self.cfg.serve.api_key, self.success_at))

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """Copy the learner's weights into the served model (between generate calls), then
        ``publish`` them to its engine (one with weights of its own reloads them)."""
        with self.server.weights_lock, torch.no_grad():
            served = self.server.model
            if served is not model:
                for mine, theirs in zip(served.parameters(), model.parameters(), strict=True):
                    mine.copy_(theirs)
            publish(self.server.engine, served, version)
        self.version = version

    def wait_ready(self) -> None:
        if self.off_policy and not self.thread.is_alive():
            self.thread.start()

    def collect(self, step: int) -> list[Episode]:
        groups = self.cfg.rollout.groups_per_step
        if self.off_policy:
            self.taken = self._take(groups)
            return [ep for g in self.taken for ep in g.episodes]
        step_tasks = [self.tasks[(step * groups + g) % len(self.tasks)] for g in range(groups)]
        episodes, left_out = asyncio.run(play_groups(
            self.server, self.base_url, self.rollout, step_tasks, self.cfg.rollout.group_size,
            step, self.cfg.rollout.temperature, self.judge))
        self.left_out += left_out
        if left_out:
            reasons = sorted({x["reason"] for x in left_out})
            print(f"step {step + 1}: {len(left_out)} episodes left out of training: "
                  f"{'; '.join(reasons)}")
        if not episodes:
            raise RuntimeError(f"step {step + 1}: no episode could be trained on "
                               f"({left_out[0]['reason'] if left_out else 'no tasks'})")
        return episodes

    def updating(self) -> AbstractContextManager:
        # In sync mode the server samples with the learner's own weights.
        return nullcontext() if self.off_policy else self.server.weights_lock

    def step_metrics(self, step: int, episodes: list[Episode],
                     update_metrics: dict[str, float]) -> dict[str, float]:
        self.rewards.append(update_metrics["reward/mean"])
        metrics = {"episode/left_out": float(sum(x["step"] == step for x in self.left_out)),
                   "episode/segments": float(len(episodes))}
        if self.off_policy:
            self.trained_staleness += [group_staleness(g, step) for g in self.taken]
            metrics.update(self.buffer.step_metrics(step, self.taken,
                                                    self.cfg.staleness.max_versions,
                                                    also_buffered=self.arrivals.qsize()))
        return metrics

    def state_dict(self) -> dict:
        return {"next_assignment": self.next_assignment} if self.off_policy else {}

    def close(self) -> None:
        """Stop the agents (runs in flight are cancelled) and the server."""
        self._stop_agents()
        if self.running is not None:
            self.running.__exit__(None, None, None)
            self.running = None

    def result(self, result: TrainResult) -> AgentTrainResult:
        if self.buffer.dropped:
            print(f"{len(self.buffer.dropped)} groups dropped as more than "
                  f"{self.cfg.staleness.max_versions} versions behind")
        return AgentTrainResult(**vars(result), rewards=self.rewards, left_out=self.left_out,
                                staleness=self.trained_staleness, dropped=self.buffer.dropped)

    # ---- async: the agents' loop (its own thread and event loop) ------------------------------

    def _take(self, need: int) -> list[Group]:
        """The first ``need`` complete groups at most ``max_versions`` behind (arrival order)."""
        buffer, bound = self.buffer, self.cfg.staleness.max_versions
        buffer.start_collection(self.version, bound)
        while True:
            arrived = []
            while not self.arrivals.empty():
                arrived.append(self.arrivals.get_nowait())
            buffer.add(arrived, self.version, bound)
            if (groups := buffer.take(need)) is not None:
                return groups
            if self.error is not None:
                raise RuntimeError(f"the agents' loop failed: {self.error}") from self.error
            buffer.check_stall()
            with buffer.waiting():
                try:
                    buffer.add([self.arrivals.get(timeout=1.0)], self.version, bound)
                except queue.Empty:
                    pass

    def _stop_agents(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=60)

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
        episodes, left_out = await play_groups(
            self.server, self.base_url, self.rollout, [self.tasks[index]],
            self.cfg.rollout.group_size, self.version, self.cfg.rollout.temperature,
            self.judge, first_group=assignment)
        self.left_out += left_out
        if not episodes:
            return None
        return Group(assignment, index, episodes, started_at=started,
                     finished_at=time.perf_counter())
