"""Train agent code written against the OpenAI API: ``train_agent(rollout, tasks, cfg)``.

The user's ``async def rollout(client, task) -> float | None`` talks to the policy only
through ``client`` (an ``openai.AsyncOpenAI`` pointed at a live ``turnrl serve`` in this
process, its episode id set as the ``X-TurnRL-Episode`` header) and returns the episode's
reward. Each step:

    collect   group_size rollouts of each of groups_per_step tasks, all at once (the server
              batches their calls); each rollout's calls are recorded as one episode
    score     the returned reward is set on the episode; None, an exception, or an episode
              sampled at another temperature than rollout.temperature is reported and left out
    rl_step   the repo's one RL step (trainer/rl_step.py) on the recorded token ids; segments
              of one episode share its advantage (computed once per episode, per task group)
    publish   engine.version += 1: the server samples with the updated weights (the served
              model is the trained one; the engine's weights lock keeps the update between
              generate calls), and the next step's calls carry the new version

then ``end_step`` (metrics.jsonl, progress, checkpoints) as ``turnrl train`` does. This is the
synchronous mode: every step's episodes come from the current weights, so the update is
on-policy; rollouts of one step run concurrently, steps one after another.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from turnrl.config import Config, ConfigError
from turnrl.evaluation import COLUMNS, EvalResult
from turnrl.metrics import print_table
from turnrl.serve.app import RunningServer
from turnrl.serve.judge import judge_group
from turnrl.serve.protocol import EPISODE_HEADER
from turnrl.serve.record import RecordedEpisode, training_episodes
from turnrl.serve.server import Server
from turnrl.trainer.rl_step import rl_step
from turnrl.trainer.run import StageTimer, end_step, start_run, step_logging
from turnrl.types import Episode

Rollout = Callable[..., Awaitable[float | None]]


@dataclass
class AgentTrainResult:
    run_dir: Path
    rewards: list[float] = field(default_factory=list)
    """Mean reward of the trained episodes, per step."""
    left_out: list[dict] = field(default_factory=list)
    """Episodes not trained on: {"step", "episode_id", "reason"}."""
    before: EvalResult | None = None
    after: EvalResult | None = None
    table: str = ""
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
        if values.dim() != 1:
            raise ConfigError("train_agent needs an outcome-level algo.advantage (grpo, rloo, "
                              "dr_grpo, ...): recorded episodes carry no env states or turns "
                              "for turn-level credit")
        return values[torch.tensor(index)]

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()

    def state_dict(self) -> dict:
        return self.inner.state_dict()


def usable(recorded: RecordedEpisode, temperature: float) -> str:
    """"" when the episode can be trained on, else why not."""
    if recorded.reward is None:
        return "no reward"
    if not recorded.segments:
        return "no calls to the model"
    used = {t for s in recorded.segments for t in s.temperatures}
    if used != {temperature}:
        return (f"sampled at temperature {sorted(used)}, not rollout.temperature {temperature} "
                "(the update scores tokens at that temperature)")
    return ""


async def evaluate_agent(rollout: Rollout, tasks: Sequence, base_url: str, api_key: str = "",
                         success_at: float = 1.0) -> EvalResult:
    """Play each task once, unrecorded (no episode id); success: reward >= ``success_at``.
    A rollout that raises or returns None counts as a failed episode, not a dropped one."""
    from openai import AsyncOpenAI

    async def one(task) -> float | None:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key or "unused",
                               max_retries=0) as client:
            try:
                return await rollout(client, task)
            except Exception:  # noqa: BLE001 - counted as failed below
                return None

    rewards = await asyncio.gather(*(one(task) for task in tasks))
    scored = [r for r in rewards if r is not None]
    return EvalResult(episodes=len(rewards), successes=sum(r >= success_at for r in scored),
                      mean_reward=sum(scored) / max(len(rewards), 1), mean_turns=float("nan"),
                      failed=len(rewards) - len(scored))


Judge = Callable[[object, list[str]], Awaitable[list[float] | None]]
"""``(task, transcripts) -> scores in [0, 1] or None``: rewards for a group's episodes."""


async def _play(rollout: Rollout, base_url: str, api_key: str, task, episode_id: str
                ) -> tuple[float | None, str]:
    """Run one rollout: (its reward, "") or (None, why it failed)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key or "unused", max_retries=0,
                         default_headers={EPISODE_HEADER: episode_id})
    try:
        reward = await rollout(client, task)
    except Exception as err:  # noqa: BLE001 - a failing agent fails its own episode
        return None, f"rollout raised {type(err).__name__}: {err}"
    finally:
        await client.close()
    return (None, "") if reward is None else (float(reward), "")


def self_judge(base_url: str, model: str, api_key: str = "") -> Judge:
    """The served policy as the judge (``judge.judge_group``; its calls are not recorded)."""
    async def judge(task, transcripts: list[str]) -> list[float] | None:
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=base_url, api_key=api_key or "unused",
                               max_retries=0) as client:
            return await judge_group(client, model, str(task), transcripts)
    return judge


async def collect(server: Server, base_url: str, rollout: Rollout, step_tasks: Sequence,
                  group_size: int, step: int, temperature: float, judge: Judge | None = None,
                  first_group: int = 0) -> tuple[list[Episode], list[dict]]:
    """Play ``group_size`` rollouts of each task at once; the trainable episodes (grouped by
    task: ``Episode.group`` is ``first_group`` + the task's index) and the ones left out, with
    their reasons. With ``judge``, the episodes of a group whose rollout returned None are
    scored by it, relative to each other."""
    ids = [[f"step{step}-task{g}-{k}-{uuid.uuid4().hex[:8]}" for k in range(group_size)]
           for g in range(len(step_tasks))]
    flat = [e for group in ids for e in group]
    played = await asyncio.gather(*(
        _play(rollout, base_url, server.cfg.api_key, task, episode_id)
        for task, group in zip(step_tasks, ids, strict=True) for episode_id in group))
    rewards = {e: r for e, (r, _) in zip(flat, played, strict=True)}
    errors = {e: why for e, (_, why) in zip(flat, played, strict=True)}
    recorder = server.recorder
    for task, group in zip(step_tasks, ids, strict=True):
        unscored = [e for e in group if rewards[e] is None and not errors[e]
                    and e in recorder.episodes]
        if judge is not None and unscored:
            scores = await judge(task, [max((s.text for s in recorder.episodes[e].segments),
                                            key=len) for e in unscored])
            for e, score in zip(unscored, scores or [], strict=False):
                rewards[e] = score
            if scores is None:
                errors.update({e: "the judge gave no scores" for e in unscored})
        for e in group:
            if rewards[e] is not None and e in recorder.episodes:
                recorder.set_reward(e, rewards[e])
    recorded = {r.episode_id: r for r in recorder.take(flat)}
    episodes, left_out = [], []
    for g, group in enumerate(ids):
        for e in group:
            why = (errors[e] or ("rollout returned None" if rewards[e] is None else "")
                   or ("no calls to the model" if e not in recorded
                       else usable(recorded[e], temperature)))
            if why:
                left_out.append({"step": step, "episode_id": e, "reason": why})
            else:
                episodes += training_episodes(recorded[e], group=first_group + g)
    return episodes, left_out


def train_agent(rollout: Rollout, tasks: Sequence, cfg: Config, *,
                eval_tasks: Sequence = (), success_at: float = 1.0,
                judge: Judge | str | None = None, resume: bool = False) -> AgentTrainResult:
    """Train the policy of ``cfg`` on ``rollout`` over ``tasks`` (``run.steps`` steps of
    ``rollout.groups_per_step`` tasks, taken in turn, ``rollout.group_size`` runs each);
    with ``eval_tasks``, play them before and after training (``evaluate_agent``). ``judge``
    ("self": the served policy, or a ``Judge``) scores the episodes whose rollout returns None
    (docs/serving.md: weaker than a verifiable reward). ``resume`` continues the run in
    ``run.out_dir`` from its last checkpoint (as ``turnrl train --resume``).
    Call it from synchronous code (it runs each step's rollouts with ``asyncio.run``)."""
    if not tasks:
        raise ConfigError("train_agent needs at least one task")
    if cfg.serve.train_mode == "async":
        from turnrl.serve.async_train import train_agent_async

        if resume:
            raise ConfigError("train_agent resume is for serve.train_mode sync; an async run "
                              "starts afresh")
        return train_agent_async(rollout, tasks, cfg, eval_tasks=eval_tasks,
                                 success_at=success_at, judge=judge)
    run = start_run(cfg, resume=resume)
    cfg = run.cfg
    server = Server.from_policy(run.policy, cfg)
    learner = replace(run.learner, estimator=PerEpisodeAdvantages(run.learner.estimator))
    result = AgentTrainResult(run.run_dir)
    groups = cfg.rollout.groups_per_step
    with RunningServer(server, cfg.serve.host, cfg.serve.port) as running, \
            step_logging(run, "agent") as (logger, progress):
        print(f"serving the policy at {running.base_url} while training")
        if judge == "self":
            judge = self_judge(running.base_url, server.name, cfg.serve.api_key)
        if eval_tasks:
            result.before = asyncio.run(evaluate_agent(rollout, eval_tasks, running.base_url,
                                                       cfg.serve.api_key, success_at))
        for step in range(run.start_step, cfg.run.steps):
            timer = StageTimer()
            step_tasks = [tasks[(step * groups + g) % len(tasks)] for g in range(groups)]
            with timer("collect"):
                episodes, left_out = asyncio.run(collect(
                    server, running.base_url, rollout, step_tasks, cfg.rollout.group_size,
                    step, cfg.rollout.temperature, judge))
            result.left_out += left_out
            if left_out:
                reasons = sorted({x["reason"] for x in left_out})
                print(f"step {step + 1}: {len(left_out)} episodes left out of training: "
                      f"{'; '.join(reasons)}")
            if not episodes:
                raise RuntimeError(f"step {step + 1}: no episode could be trained on "
                                   f"({left_out[0]['reason'] if left_out else 'no tasks'})")
            with server.weights_lock:  # between generate calls: no request sees half an update
                summary, metrics = rl_step(learner, episodes, timer)
                server.engine.version = step + 1
            metrics["episode/left_out"] = float(len(left_out))
            metrics["episode/segments"] = float(len(episodes))
            result.rewards.append(summary.mean_reward)
            end_step(run, step, episodes, summary, metrics, timer, logger, progress)
        if eval_tasks:
            result.after = asyncio.run(evaluate_agent(rollout, eval_tasks, running.base_url,
                                                      cfg.serve.api_key, success_at))
    return summarize_agent(result, eval_tasks, cfg.run.steps)


def summarize_agent(result: AgentTrainResult, eval_tasks: Sequence, steps: int
                    ) -> AgentTrainResult:
    """Print and save the before/after table when both evaluations ran."""
    if result.before and result.after:
        result.table = print_table(
            f"agent: {len(eval_tasks)} held-out tasks, before vs after", COLUMNS,
            [result.before.row("before"), result.after.row(f"after {steps} steps")])
        (result.run_dir / "summary.txt").write_text(result.table)
    return result
