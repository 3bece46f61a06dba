"""Agent code written against the OpenAI API, played against a live ``turnrl serve``.

The user's ``async def rollout(client, task) -> float | None`` talks to the policy only
through ``client`` (an ``openai.AsyncOpenAI`` pointed at the server, its episode id set as the
``X-TurnRL-Episode`` header, so each run's calls are recorded as one episode) and returns the
episode's reward. ``play_groups`` plays a set of tasks ``group_size`` times each and turns the
recordings into trainable episodes (``ServedSource`` in serve/source.py collects with it);
``evaluate_agent`` plays held-out tasks unrecorded.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Awaitable, Callable, Sequence

from turnrl.evaluation import EvalResult
from turnrl.serve.judge import judge_group
from turnrl.serve.protocol import EPISODE_HEADER
from turnrl.serve.record import RecordedEpisode, training_episodes
from turnrl.serve.server import Server
from turnrl.tools.mcp.http import one_line
from turnrl.types import Episode

Rollout = Callable[..., Awaitable[float | None]]


def usable(recorded: RecordedEpisode, temperature: float) -> str:
    """"" when the episode can be trained on, else why not."""
    if recorded.reward is None:
        return "no reward"
    problem = Episode("served", 0, 0).reward_problem(recorded.reward)
    if problem is not None:  # Recorder.set_reward refuses these; a reward set directly too
        return problem
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
    if reward is None:
        return None, ""
    problem = Episode("served", 0, 0).reward_problem(reward)
    if problem is not None:  # not a number, or not finite: this episode fails alone
        return None, f"rollout returned {problem}"
    return float(reward), ""


class JudgeError(RuntimeError):
    """The judge's endpoint failed (one line: where, why, what to check): its group gets no
    reward and is left out, with this reason."""


def self_judge(base_url: str, model: str, api_key: str = "", timeout_s: float = 120.0
               ) -> Judge:
    """The served policy as the judge (``judge.judge_group``; its calls are not recorded),
    each call within ``timeout_s``; ``JudgeError`` when the endpoint fails."""
    async def judge(task, transcripts: list[str]) -> list[float] | None:
        from openai import AsyncOpenAI, OpenAIError

        try:
            async with AsyncOpenAI(base_url=base_url, api_key=api_key or "unused",
                                   max_retries=0, timeout=timeout_s) as client:
                return await judge_group(client, model, str(task), transcripts)
        except (OpenAIError, ValueError) as err:  # a body that is not JSON: ValueError
            raise JudgeError(f"the judge '{model}' at {base_url} failed ({type(err).__name__}: "
                             f"{one_line(str(err), 200)}): check that it is running and "
                             f"serves '{model}'") from None
    return judge


async def judged(judge: Judge, task, transcripts: list[str]) -> tuple[list[float] | None, str]:
    """The judge's scores for ``transcripts`` (finite numbers, one each), or None and why not:
    a judge that raises or answers out of shape fails its own group, not the step."""
    try:
        scores = await judge(task, transcripts)
    except Exception as err:  # noqa: BLE001 - the group is left out with the reason
        return None, f"the judge raised {type(err).__name__}: {one_line(str(err), 300)}"
    if scores is None:
        return None, "the judge gave no scores"
    if not (isinstance(scores, list) and len(scores) == len(transcripts) and all(
            isinstance(s, int | float) and not isinstance(s, bool) and math.isfinite(s)
            for s in scores)):
        return None, (f"the judge returned {one_line(repr(scores), 100)}, not "
                      f"{len(transcripts)} finite numbers")
    return [float(s) for s in scores], ""


async def play_groups(server: Server, base_url: str, rollout: Rollout, step_tasks: Sequence,
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
            scores, why = await judged(judge, task, [
                max((s.text for s in recorder.episodes[e].segments), key=len)
                for e in unscored])
            for e, score in zip(unscored, scores or [], strict=False):
                rewards[e] = score
            errors.update({e: why for e in unscored if why})
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
