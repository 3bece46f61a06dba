"""Run set-up, for the one learner loop (trainer/learn.py) and SFT.

A run directory holds the resolved config, metrics, sample episodes, before/after
evaluations and atomic checkpoints. ``start_run`` creates or reopens it, seeds every random
stream, loads the policy and builds the ``Learner`` (what ``rl_step`` needs,
trainer/rl_step.py), restoring a checkpoint when resuming. What follows each step and the
run is ``trainer/bookkeeping.py``'s; the held-out evaluation, ``trainer/evaluation.py``'s.

Exact resume: a checkpoint stores every random stream (python, numpy, torch, the engine's
sampler), and the "before" evaluation stores the streams as it left them, so a run killed
anywhere (before its first checkpoint too) continues on the draws an uninterrupted run makes.
"""

from __future__ import annotations

import copy
import random
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from turnrl.algorithms.estimators import EstimatorSettings, make_estimator
from turnrl.algorithms.exploration import Exploration
from turnrl.algorithms.replay import SuccessReplay
from turnrl.checkpoint import latest_checkpoint, load_checkpoint, load_component, restore_rng
from turnrl.config import (
    Config,
    ConfigError,
    changed_keys,
    load_run_config,
    save_config,
)
from turnrl.learner.shard import broadcast_weights, shard
from turnrl.learner.world import World
from turnrl.learner.world import current as current_world
from turnrl.lora import is_lora
from turnrl.metrics import truncate_metrics
from turnrl.models import configure_torch
from turnrl.policy import Policy, load_policy, publish
from turnrl.samplers import chooser
from turnrl.trainer.collapse import CollapseMonitor
from turnrl.trainer.distill import load_teacher
from turnrl.trainer.reference import restore_reference
from turnrl.trainer.rl_step import Learner
from turnrl.trainer.step import UpdateSettings, activation_bytes_per_token, make_optimizer

RESUMABLE = ("run.steps", "run.progress", "learner.world_size", "learner.timeout_s",
             "learner.port", "learner.launcher", "learner.placement")
"""Config keys a resumed run may change; anything else would silently change the run."""
_PER_RUN_FILES = ("metrics.jsonl", "eval_before.json", "eval_before.jsonl", "eval_before.rng",
                  "eval_after.json", "eval_after.jsonl", "summary.txt")


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
    return learner_for(cfg, policy.model, policy.tokenizer, decoupled=decoupled,
                       world=current_world())


def learner_for(cfg: Config, model: torch.nn.Module, tokenizer, *, decoupled: bool = False,
                world: World | None = None) -> Learner:
    """The ``Learner`` of ``model``; with learner ranks (``world``), the model (and a separate
    KL reference) split over them from rank 0's weights, before the optimiser sees them."""
    settings = update_settings(cfg, model)
    replay = SuccessReplay(cfg.explore.success_replay_age) if cfg.explore.success_replay_age else None
    if decoupled or replay is not None:  # off-policy data needs the decoupled objective
        settings = replace(settings, algo=replace(settings.algo, decoupled=True))
    explore = Exploration(cfg.explore, steps=cfg.run.steps, temperature=cfg.rollout.temperature,
                          entropy_coef=cfg.algo.entropy_coef,
                          max_policy_tokens=cfg.rollout.max_new_tokens * cfg.rollout.max_turns)
    if world is not None:
        broadcast_weights(model, world)
    reference = reference_model(model) if cfg.algo.kl_coef > 0 else None
    if world is not None:
        for split in {id(m): m for m in (model, reference) if m is not None}.values():
            shard(split, world, cfg.learner)
    return Learner(model, make_optimizer(model, cfg.optim), settings,
                   make_estimator(EstimatorSettings.from_config(cfg, model.config.hidden_size)),
                   tokenizer.pad_token_id, reference, explore,
                   load_teacher(cfg, tokenizer, next(model.parameters()).device),
                   cfg.distill, world, replay,
                   CollapseMonitor(cfg.run.collapse_every, cfg.run.collapse_prompts,
                                   cfg.run.collapse_replies) if cfg.run.collapse_every else None)


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
    world = current_world()
    if world is not None:  # the other learner ranks build their share alongside
        world.command("start", (cfg, checkpoint, decoupled))
    seed_run(cfg, threads)
    policy = load_policy(cfg)
    if world is not None and world.strategy == "fsdp":
        policy.engine = own_sampler(cfg, policy)
    learner = build_learner(cfg, policy, decoupled=decoupled)
    run = Run(cfg, run_dir, policy, learner, start_step=0, resumed=resume)
    if checkpoint is not None:
        state, rng = restore_learner(checkpoint, learner)
        restore_reference(checkpoint, learner, state["step"], cfg.algo.reference_reset_every)
        restore_rng(rng, policy.engine.generator)
        run.start_step = state["step"]
        publish(policy.engine, policy.model, run.start_step)  # the checkpoint's weights
        run.checkpoint_state, run.checkpoint = state, checkpoint
        print(f"resuming {run_dir} from step {run.start_step}")
    else:
        print(f"run directory: {run_dir}")
    # Steps logged after the checkpoint (or by a run that never checkpointed) are redone.
    truncate_metrics(run_dir / "metrics.jsonl", after_step=run.start_step)
    return run


def seed_run(cfg: Config, threads: int | None = None) -> None:
    """Torch's threads, and every random stream seeded from ``run.seed``."""
    configure_torch(cfg.run.threads if threads is None else threads)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)


def restore_learner(checkpoint: Path, learner: Learner) -> tuple[dict, dict]:
    """The checkpoint's model, optimiser, estimator and exploration state into ``learner``
    (on every learner rank at once: a sharded checkpoint loads collectively); returns
    (state.json contents, random streams)."""
    state, rng = load_checkpoint(checkpoint, learner.model, learner.optimizer)
    saved = load_component(checkpoint, "estimator") or load_component(checkpoint, "credit")
    if saved:  # "credit": checkpoints written before estimators had one interface
        learner.estimator.load_state_dict(saved)
    learner.explore.load_state_dict(load_component(checkpoint, "exploration") or {})
    if learner.replay is not None:
        learner.replay.load_state_dict(load_component(checkpoint, "replay") or {})
    return state, rng


def own_sampler(cfg: Config, policy: Policy):
    """An HF sampler that samples from its own whole copy of the model, for rank 0 when the
    learner's weights are about to become FSDP shards (a sampler on them would see 1/N);
    another sampler already holds its own weights."""
    if getattr(policy.engine, "model", None) is not policy.model:
        return policy.engine
    policy.engine.close()
    dtype = str(policy.model.dtype).removeprefix("torch.")
    return chooser.build("hf", dtype, policy.model, policy.tokenizer.pad_token_id,
                         seed=cfg.run.seed, own_copy=True, reuse_cache=cfg.sampler.reuse_cache,
                         matmul=cfg.sampler.matmul)
