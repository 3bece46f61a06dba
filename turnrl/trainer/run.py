"""Run set-up and what follows each step, for the one learner loop (trainer/learn.py).

A run directory holds the resolved config, metrics, sample episodes, before/after
evaluations and atomic checkpoints. ``start_run`` creates or reopens it, seeds every random
stream, loads the policy and builds the ``Learner`` (what ``rl_step`` needs), restoring a
checkpoint when resuming; ``end_step`` does what follows every step, whatever the source
(sample episodes, periodic evaluation, metrics, progress, checkpoint); ``evaluate_env`` is
the held-out evaluation on the run's env; ``finish_run`` prints the before/after table.

Exact resume: a checkpoint stores every random stream (python, numpy, torch, the engine's
sampler), and the "before" evaluation stores the streams as it left them, so a run killed
anywhere (before its first checkpoint too) continues on the draws an uninterrupted run makes.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from turnrl import safe_json
from turnrl.algorithms.estimators import AdvantageEstimator, EstimatorSettings, make_estimator
from turnrl.algorithms.exploration import Exploration
from turnrl.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_component,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from turnrl.config import (
    Config,
    ConfigError,
    DistillConfig,
    ExploreConfig,
    changed_keys,
    config_to_dict,
    load_run_config,
    save_config,
)
from turnrl.evaluation import (
    COLUMNS,
    EvalResult,
    episode_transcript,
    summarize,
    whole_games,
)
from turnrl.lora import is_lora
from turnrl.metrics import MetricsLogger, TrainProgress, print_table, truncate_metrics
from turnrl.models import configure_torch
from turnrl.policy import Policy, load_policy
from turnrl.rollout import run_episodes, run_sync
from turnrl.selfplay.outcomes import game_step_metrics
from turnrl.trainer.distill import load_teacher
from turnrl.trainer.step import UpdateSettings, activation_bytes_per_token, make_optimizer
from turnrl.types import Episode, write_episodes

RESUMABLE = ("run.steps", "run.progress")
"""Config keys a resumed run may change; anything else would silently change the run."""
_PER_RUN_FILES = ("metrics.jsonl", "eval_before.json", "eval_before.jsonl", "eval_before.rng",
                  "eval_after.json", "eval_after.jsonl", "summary.txt")


class StageTimer:
    """``with timer("collect"): ...`` accumulates wall seconds per named stage."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``time/<stage>_s`` per stage and ``time/step_s`` since the timer was made."""
        return {**{f"time/{k}_s": v for k, v in self.seconds.items()},
                "time/step_s": time.perf_counter() - self.started}


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    before: EvalResult | None
    after: EvalResult | None
    table: str


@dataclass
class Learner:
    """What one RL step needs: the model it updates and how (see ``rl_step``)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    settings: UpdateSettings
    estimator: AdvantageEstimator
    pad_id: int
    ref_model: torch.nn.Module | None = None
    explore: Exploration = field(default_factory=lambda: Exploration(
        ExploreConfig(), steps=1, temperature=1.0, entropy_coef=0.0, max_policy_tokens=1))
    """The ``explore`` options' stage (off by default)."""
    teacher: torch.nn.Module | None = None
    """The frozen teacher of on-policy distillation (``distill``; None = off)."""
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class Run:
    cfg: Config
    run_dir: Path
    policy: Policy
    learner: Learner
    start_step: int
    checkpoint_state: dict = field(default_factory=dict)
    """``state.json`` of the checkpoint resumed from (mode-specific extras included)."""
    resumed: bool = False
    checkpoint: Path | None = None
    """The checkpoint resumed from (a source reads its ``frozen`` weights there)."""


def with_out_dir(cfg: Config, resume: bool) -> Config:
    """``cfg`` with its run directory named: ``run.out_dir``, else runs/<env>-<date>-<time>."""
    if cfg.run.out_dir:
        return cfg
    if resume:
        raise ConfigError("--resume needs --run.out_dir RUN_DIR, the run to continue")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return replace(cfg, run=replace(cfg.run, out_dir=f"runs/{cfg.env.name}-{stamp}"))


def prepare_run_dir(cfg: Config, resume: bool) -> tuple[Config, Path | None]:
    """Create or reopen the run directory; return the config to run and the checkpoint."""
    cfg = with_out_dir(cfg, resume)
    run_dir = Path(cfg.run.out_dir)
    checkpoint = latest_checkpoint(run_dir)
    saved = run_dir / "config.yaml"
    if resume:
        if not saved.exists():
            raise ConfigError(f"nothing to resume in '{run_dir}' (no config.yaml); "
                              "drop --resume to start a new run")
        stored = load_run_config(str(saved))  # ConfigError (one line) if unreadable
        changed = [key for key in changed_keys(stored, cfg) if key not in RESUMABLE]
        if changed:
            raise ConfigError(f"cannot change {', '.join(changed)} when resuming '{run_dir}'; "
                              f"only {', '.join(RESUMABLE)} may change: start a new run instead")
    elif checkpoint is not None:
        raise ConfigError(f"run directory '{run_dir}' already has checkpoints; pass --resume to "
                          "continue it or choose another --run.out_dir")
    else:  # a new run: what an attempt that never checkpointed left behind is stale
        for name in _PER_RUN_FILES:
            (run_dir / name).unlink(missing_ok=True)
        shutil.rmtree(run_dir / "episodes", ignore_errors=True)
        shutil.rmtree(run_dir / "samples", ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, saved)
    return cfg, checkpoint if resume else None


def update_settings(cfg: Config, model: torch.nn.Module) -> UpdateSettings:
    """The update's knobs from the config; the memory budget becomes a token budget."""
    budget = cfg.optim.memory_budget_mb * 2**20
    dtype_bytes = torch.finfo(next(model.parameters()).dtype).bits // 8
    return UpdateSettings(
        cfg.algo, cfg.optim, cfg.rollout.temperature,
        agg_constant=cfg.algo.loss_agg_constant
        or cfg.rollout.max_new_tokens * cfg.rollout.max_turns,
        token_budget=budget // activation_bytes_per_token(model.config, dtype_bytes))


def build_learner(cfg: Config, policy: Policy, *, decoupled: bool = False) -> Learner:
    model = policy.model
    settings = update_settings(cfg, model)
    if decoupled:  # off-policy data needs the decoupled objective
        settings = replace(settings, algo=replace(settings.algo, decoupled=True))
    explore = Exploration(cfg.explore, steps=cfg.run.steps, temperature=cfg.rollout.temperature,
                          entropy_coef=cfg.algo.entropy_coef,
                          max_policy_tokens=cfg.rollout.max_new_tokens * cfg.rollout.max_turns)
    return Learner(model, make_optimizer(model, cfg.optim), settings,
                   make_estimator(EstimatorSettings.from_config(cfg, model.config.hidden_size)),
                   policy.tokenizer.pad_token_id,
                   reference_model(model) if cfg.algo.kl_coef > 0 else None, explore,
                   load_teacher(cfg, policy.tokenizer, next(model.parameters()).device),
                   cfg.distill)


def reference_model(model: torch.nn.Module) -> torch.nn.Module:
    """The KL reference: a frozen copy of the initial model; a LoRA policy is its own
    reference (scored with the adapter disabled, ``turnrl.lora.adapter_disabled``), so no
    second copy of the base is held."""
    return model if is_lora(model) else copy.deepcopy(model).eval()


def start_run(cfg: Config, resume: bool, *, threads: int | None = None,
              decoupled: bool = False) -> Run:
    """Open the run directory, seed, load the policy and learner, restore a checkpoint."""
    cfg, checkpoint = prepare_run_dir(cfg, resume)
    run_dir = Path(cfg.run.out_dir)
    configure_torch(cfg.run.threads if threads is None else threads)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    policy = load_policy(cfg)
    learner = build_learner(cfg, policy, decoupled=decoupled)
    run = Run(cfg, run_dir, policy, learner, start_step=0, resumed=resume)
    if checkpoint is not None:
        state, rng = load_checkpoint(checkpoint, learner.model, learner.optimizer)
        restore_rng(rng, policy.engine.generator)
        run.start_step = policy.engine.version = state["step"]
        run.checkpoint_state, run.checkpoint = state, checkpoint
        saved = load_component(checkpoint, "estimator") or load_component(checkpoint, "credit")
        if saved:  # "credit": checkpoints written before estimators had one interface
            learner.estimator.load_state_dict(saved)
        learner.explore.load_state_dict(load_component(checkpoint, "exploration") or {})
        print(f"resuming {run_dir} from step {run.start_step}")
    else:
        print(f"run directory: {run_dir}")
    # Steps logged after the checkpoint (or by a run that never checkpointed) are redone.
    truncate_metrics(run_dir / "metrics.jsonl", after_step=run.start_step)
    return run


def play_seeds(run: Run, seeds: list[tuple[int, int]], make) -> list[Episode]:
    """Play ``(seed, group)`` pairs to the end on the learner's own engine (its current
    weights) at the step's (scheduled) temperature, on envs from ``make``."""
    cfg, policy = run.cfg, run.policy
    params = replace(policy.params, temperature=run.learner.explore.temperature())
    return run_sync(run_episodes(
        make, seeds, policy.engine, policy.chat, params, env_name=cfg.env.name,
        max_turns=cfg.rollout.max_turns, max_context=policy.max_context,
        env_timeout_s=cfg.rollout.env_timeout_s))


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
    result, episodes = run.policy.run_eval()
    write_episodes(path.with_suffix(".jsonl"), episodes)
    _atomic_write(rng_file, lambda f: torch.save(rng_state(run.policy.engine.generator), f))
    _atomic_write(result_file, lambda f: f.write(safe_json.dumps(result.to_dict()).encode()))
    return result


def evaluate_after(run: Run) -> EvalResult:
    """The held-out evaluation after training, saved with a solved and an unsolved episode
    for the report."""
    path = run.run_dir / "eval_after"
    after, episodes = run.policy.run_eval()
    write_episodes(path.with_suffix(".jsonl"), episodes)
    _atomic_write(path.with_suffix(".json"),
                  lambda f: f.write(safe_json.dumps(after.to_dict()).encode()))
    write_transcripts(run, "eval_after", [ep for ep in episodes if ep.success][:1]
                      + [ep for ep in episodes if not ep.success][:1])
    return after


def _read_eval(path: Path) -> EvalResult:
    return EvalResult.from_dict(json.loads(path.read_text()))


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
    tmp.replace(path)


@contextmanager
def step_logging(run: Run, description: str) -> Iterator[tuple[MetricsLogger, TrainProgress]]:
    """The metrics logger and the progress bar of the training loop."""
    cfg = run.cfg
    # run.tensorboard means "when installed": no warning on machines without it.
    tensorboard = cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is not None
    logger = MetricsLogger(run.run_dir, tensorboard=tensorboard, wandb=cfg.run.wandb,
                           wandb_project=cfg.run.wandb_project, config=config_to_dict(cfg))
    (run.run_dir / "episodes").mkdir(exist_ok=True)
    with logger, TrainProgress(cfg.run.steps, start_step=run.start_step,
                               enabled=cfg.run.progress, description=description,
                               length_unit="turns") as progress:
        yield logger, progress


def episode_metrics(episodes: list[Episode]) -> tuple[EvalResult, dict[str, float]]:
    """What a step's episodes say: reward, success, length."""
    summary = summarize(episodes)
    rewards = [ep.reward for ep in episodes]
    return summary, {
        "reward/mean": summary.mean_reward,
        "reward/std": float(np.std(rewards, ddof=1)) if len(rewards) > 1 else 0.0,
        "success/rate": summary.success_rate,
        "episode/turns": summary.mean_turns,
        "episode/tokens": float(np.mean([len(ep.token_ids) for ep in episodes])),
        "episode/policy_tokens": float(np.mean([ep.num_policy_tokens for ep in episodes])),
        "episode/failed": summary.failed,
        **game_step_metrics(episodes),
    }


def periodic_eval(run: Run, step: int) -> dict[str, float]:
    """Held-out metrics every ``eval.every`` steps (the last step gets the 'after' table)."""
    cfg = run.cfg
    if not cfg.eval.every or (step + 1) % cfg.eval.every or step + 1 >= cfg.run.steps:
        return {}
    result, _ = run.policy.run_eval()
    lo, hi = result.interval
    per_env = {f"eval/{label}/{key}": value for label, r in (result.per_env or {}).items()
               for key, value in (("success", r.success_rate), ("reward", r.mean_reward))}
    return {"eval/success": result.success_rate, "eval/success_lo": lo,
            "eval/success_hi": hi, "eval/reward": result.mean_reward, **per_env,
            **{f"eval/{k}": v for k, v in (result.env_metrics or {}).items()}}


def end_step(run: Run, step: int, episodes: list[Episode], summary: EvalResult | None,
             metrics: dict[str, float], timer: StageTimer, logger: MetricsLogger,
             progress: TrainProgress, *, checkpoint_extra: dict | None = None,
             checkpoint_frozen: dict[str, torch.nn.Module] | None = None,
             **progress_fields) -> None:
    """After a step's update, in every mode: samples, periodic eval, log, progress, checkpoint.
    ``summary`` None (SFT: demonstrations earn no reward) leaves reward and success off the bar."""
    cfg = run.cfg
    if cfg.run.sample_episodes:  # a self-play game's seats come together
        sample = whole_games(episodes[:cfg.run.sample_episodes], episodes)
        write_episodes(run.run_dir / "episodes" / f"step-{step + 1:06d}.jsonl", sample)
        write_transcripts(run, f"step-{step + 1:06d}", sample)
    metrics.update(periodic_eval(run, step))
    metrics.update(timer.metrics())
    logger.log(step + 1, metrics)
    warn = ",".join(k.removeprefix("warn/") for k, v in metrics.items()
                    if k.startswith("warn/") and v)
    # A stability guard's flag (algorithms/exploration.py) shows while it holds.
    progress_fields["WARN"] = warn or None
    if summary is not None:
        progress_fields = {"reward": summary.mean_reward, "turns": summary.mean_turns,
                           "success": f"{summary.success_rate:.0%}", **progress_fields}
    progress.update(step + 1, **progress_fields)
    last = step + 1 == cfg.run.steps
    if last or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
        learner = run.learner
        save_checkpoint(run.run_dir, step + 1, learner.model, learner.optimizer,
                        rng=rng_state(run.policy.engine.generator),
                        keep=cfg.run.keep_checkpoints, extra=checkpoint_extra,
                        frozen=checkpoint_frozen,
                        components={"estimator": learner.estimator.state_dict(),
                                    "exploration": learner.explore.state_dict()})


def write_transcripts(run: Run, name: str, episodes: list[Episode]) -> None:
    """A few episodes as small readable JSON (decoded policy/env parts) for the HTML report."""
    decode = lambda ids: run.policy.tokenizer.decode(ids)  # noqa: E731 - keeps special tokens
    (run.run_dir / "samples").mkdir(exist_ok=True)
    (run.run_dir / "samples" / f"{name}.json").write_text(
        safe_json.dumps([episode_transcript(ep, decode) for ep in episodes]))


def finish_run(run: Run, before: EvalResult | None, after: EvalResult | None,
               held_out: str) -> TrainResult:
    """Print (and save) the before/after table when both evaluations ran."""
    table = ""
    if before and after:
        rows = [before.row("before"), after.row(f"after {run.cfg.run.steps} steps")]
        for label in (before.per_env or {}) if after.per_env else ():  # a mix: a pair per env
            rows += [before.per_env[label].row(f"{label} before"),
                     after.per_env[label].row(f"{label} after")]
        table = print_table(f"{held_out}, before vs after", COLUMNS, rows)
        measured = after.env_metrics or {}
        for key, value in measured.items():  # what the env measured itself
            if key.endswith(("_lo", "_hi", "/episodes")):  # shown with their rate, or in the file
                continue
            line = f"{key}: {(before.env_metrics or {}).get(key, float('nan')):.4f} -> {value:.4f}"
            if f"{key}_lo" in measured:  # a per-role rate (selfplay/outcomes.py)
                line += f" [95% CI {measured[f'{key}_lo']:.4f}, {measured[f'{key}_hi']:.4f}]"
            print(line)
            table += line + "\n"
        (run.run_dir / "summary.txt").write_text(table)
    return TrainResult(run.run_dir, run.cfg.run.steps, before, after, table)
