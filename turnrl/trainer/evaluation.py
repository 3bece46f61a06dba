"""A run's held-out evaluation: which tasks, played how, and what is kept of it.

``turnrl/evaluation.py`` plays and scores episodes (success intervals, pass@k, paired tests);
this module decides what a policy is evaluated on and keeps the result:

- ``held_out_eval``: the held-out seeds ``eval.seed_offset ...`` played once with the current
  weights at ``eval.temperature`` on the env(s) evaluation plays (``Policy.eval_envs``: a
  mix's envs a row each, a self-play game's fixed opponents), with what the env measures of
  the policy and a game's per-role outcomes. ``turnrl eval`` plays its tasks the same way
  (``play_tasks``).
- ``evaluate_env``: the before/after evaluation a run's source calls
  (``RolloutSource.evaluate``; SFT too), written to ``eval_before.*`` / ``eval_after.*``;
  ``periodic_eval``: the ``eval/*`` metrics every ``eval.every`` steps (``end_step``), each
  naming the weight version it evaluated (``eval/version``); async runs log the "before"
  evaluation as version 0's row at step 0 (``base_row``), so their schedule starts with the
  base model. Every one of them plays on the learner's engine (hf, the learner's own
  tensors: no weight transfer, always the newest version).

Exact resume: evaluating draws from the engine's sampler, so the "before" evaluation stores
the streams as it left them; a run killed before its first checkpoint restores them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from turnrl import safe_json
from turnrl.checkpoint import restore_rng, rng_state
from turnrl.config import Config
from turnrl.envs import Env
from turnrl.evaluation import (
    EvalResult,
    episode_transcript,
    evaluate,
    evaluate_each,
    reply_scorer,
    with_env_metrics,
)
from turnrl.metrics import METRICS_FILE, read_metrics
from turnrl.policy import Policy
from turnrl.rollout.chat import sampling_params
from turnrl.selfplay.evaluation import with_outcome_metrics, with_outside_player
from turnrl.trainer.run import Run
from turnrl.types import Episode, write_episodes


def held_out_seeds(cfg: Config) -> list[int]:
    """The held-out tasks: ``eval.episodes`` env seeds from ``eval.seed_offset`` (training
    seeds stay below it, ``policy.training_seeds``)."""
    return list(range(cfg.eval.seed_offset, cfg.eval.seed_offset + cfg.eval.episodes))


def play_options(cfg: Config, policy: Policy) -> dict:
    """How a held-out episode is played: ``eval.temperature``, the run's turn, context and
    env-time limits (the keyword arguments of ``evaluate``)."""
    return dict(params=sampling_params(cfg, policy.chat, cfg.eval.temperature),
                max_turns=cfg.rollout.max_turns, env_timeout_s=cfg.rollout.env_timeout_s,
                max_context=policy.max_context)


def play_tasks(cfg: Config, policy: Policy, make: Callable[[], Env], seeds: Sequence[int],
               env_name: str) -> tuple[EvalResult, list[Episode]]:
    """One episode per seed on envs from ``make`` (with the run's simulated user, if it has
    one), played as ``play_options`` says."""
    return evaluate(with_outside_player(make, cfg), seeds, policy.engine, policy.chat,
                    env_name=env_name, **play_options(cfg, policy))


def held_out_eval(cfg: Config, policy: Policy) -> tuple[EvalResult, list[Episode]]:
    """The held-out seeds played once with the current weights on ``policy.eval_envs`` (a mix:
    each env, a row each in ``per_env``); the result with the env's ``policy_metrics`` (the
    policy scored as it samples) and a game's per-role outcomes, and the episodes."""
    makes = {label: with_outside_player(make, cfg) for label, make in policy.eval_envs.items()}
    seeds = held_out_seeds(cfg)
    first, options = next(iter(makes.values())), play_options(cfg, policy)
    if len(makes) > 1:  # a mix: each env on the held-out seeds, a row each
        result, episodes = evaluate_each(makes, seeds, policy.engine, policy.chat, **options)
    else:
        result, episodes = evaluate(first, seeds, policy.engine, policy.chat,
                                    env_name=cfg.env.name, **options)
    score = reply_scorer(policy.model, policy.chat, cfg.rollout.temperature)
    result = with_env_metrics(result, first(), score)
    return with_outcome_metrics(result, episodes), episodes


def evaluate_env(run: Run, when: str) -> EvalResult | None:
    """The held-out evaluation on the run's environment, ``"before"`` or ``"after"`` training
    (``eval.episodes`` seeds from ``eval.seed_offset``; None when it is 0)."""
    if run.cfg.eval.episodes == 0:
        return None
    return evaluate_before(run) if when == "before" else evaluate_after(run)


def evaluate_before(run: Run) -> EvalResult:
    """The held-out evaluation before training, run once and kept.

    Evaluating draws from the engine's sampler, so the streams it leaves behind are kept
    with the result: a run resumed before its first checkpoint restores them and samples
    step 1 exactly as the uninterrupted run did.
    """
    path = run.run_dir / "eval_before"
    rng_file, result_file = path.with_suffix(".rng"), path.with_suffix(".json")
    if result_file.exists():
        if run.start_step == 0 and rng_file.exists():  # a checkpoint's streams come later
            restore_rng(torch.load(rng_file, weights_only=False), run.policy.engine.generator)
        return _read_eval(result_file)
    result, episodes = held_out_eval(run.cfg, run.policy)
    write_episodes(path.with_suffix(".jsonl"), episodes)
    _atomic_write(rng_file, lambda f: torch.save(rng_state(run.policy.engine.generator), f))
    _atomic_write(result_file, lambda f: f.write(safe_json.dumps(result.to_dict()).encode()))
    return result


def evaluate_after(run: Run) -> EvalResult:
    """The held-out evaluation after training, saved with a solved and an unsolved episode
    for the report."""
    path = run.run_dir / "eval_after"
    after, episodes = held_out_eval(run.cfg, run.policy)
    write_episodes(path.with_suffix(".jsonl"), episodes)
    _atomic_write(path.with_suffix(".json"),
                  lambda f: f.write(safe_json.dumps(after.to_dict()).encode()))
    write_transcripts(run, "eval_after", [ep for ep in episodes if ep.success][:1]
                      + [ep for ep in episodes if not ep.success][:1])
    return after


def periodic_eval(run: Run, step: int) -> dict[str, float]:
    """Held-out metrics every ``eval.every`` steps (the last step gets the 'after' table),
    with the weight version evaluated (``eval/version``: the learner's engine has just taken
    version ``step + 1``) and the learner's seconds spent on it (``eval/learner_s``: its
    update waits that long; async workers keep generating meanwhile)."""
    cfg = run.cfg
    if not cfg.eval.every or (step + 1) % cfg.eval.every or step + 1 >= cfg.run.steps:
        return {}
    start = time.perf_counter()
    result, _ = held_out_eval(cfg, run.policy)
    return {**eval_metrics(result, run.policy.engine.version),
            "eval/learner_s": time.perf_counter() - start}


def eval_metrics(result: EvalResult, version: int) -> dict[str, float]:
    """A held-out evaluation as ``eval/*`` metrics: success with its interval, reward, a
    mix's per-env rows, what the env measured, and the weight ``version`` it evaluated."""
    lo, hi = result.interval
    per_env = {f"eval/{label}/{key}": value for label, r in (result.per_env or {}).items()
               for key, value in (("success", r.success_rate), ("reward", r.mean_reward))}
    return {"eval/success": result.success_rate, "eval/success_lo": lo,
            "eval/success_hi": hi, "eval/reward": result.mean_reward, **per_env,
            **{f"eval/{k}": v for k, v in (result.env_metrics or {}).items()},
            "eval/version": float(version)}


def base_row(run: Run, before: EvalResult | None) -> dict[str, float]:
    """The base model's row of a per-version schedule (``RolloutSource.versioned_eval``:
    async runs): the "before" evaluation as ``eval/*`` metrics of version 0, logged at step 0
    ahead of the first update; {} without a schedule (``eval.every`` 0), without an
    evaluation, or on a resumed run (its metrics.jsonl holds the row already, even one
    resumed before its first checkpoint)."""
    if before is None or not run.cfg.eval.every or run.start_step:
        return {}
    path = run.run_dir / METRICS_FILE
    if path.exists() and any(r["step"] == 0 for r in read_metrics(path)):
        return {}
    return eval_metrics(before, 0)


def write_transcripts(run: Run, name: str, episodes: list[Episode]) -> None:
    """A few episodes as small readable JSON (decoded policy/env parts) for the HTML report:
    the 'after' evaluation's, and each step's samples (``end_step``)."""
    decode = lambda ids: run.policy.tokenizer.decode(ids)  # noqa: E731 - keeps special tokens
    (run.run_dir / "samples").mkdir(exist_ok=True)
    (run.run_dir / "samples" / f"{name}.json").write_text(
        safe_json.dumps([episode_transcript(ep, decode) for ep in episodes]))


def _read_eval(path: Path) -> EvalResult:
    return EvalResult.from_dict(json.loads(path.read_text()))


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
    tmp.replace(path)
