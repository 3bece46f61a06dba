"""The synchronous trainer: collect -> score -> advantages -> update -> log, in one loop.

Every stage is named and timed (``time/<stage>_s`` in metrics.jsonl), so the loop reads and
profiles the same way. A run directory holds the resolved config, metrics, sample episodes,
before/after evaluations and atomic checkpoints; ``resume=True`` continues from the newest
checkpoint with the same config.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import yaml

from turnrl.algorithms.advantages import compute_advantages
from turnrl.algorithms.turn_credit import TurnCredit, is_turn_level
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
    changed_keys,
    config_from_dict,
    config_to_dict,
    save_config,
)
from turnrl.envs import make_env
from turnrl.evaluation import COLUMNS, EvalResult, evaluate, summarize
from turnrl.metrics import MetricsLogger, TrainProgress, print_table, truncate_metrics
from turnrl.models import configure_torch, load_model, resolve_device
from turnrl.rollout import ChatFormat, HFEngine, SamplingParams, run_episodes, run_sync
from turnrl.trainer.step import (
    UpdateSettings,
    activation_bytes_per_token,
    make_optimizer,
    policy_update,
)
from turnrl.types import Batch, write_episodes


class StageTimer:
    """``with timer("collect"): ...`` accumulates wall seconds per named stage."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    before: EvalResult | None
    after: EvalResult | None
    table: str


def training_seeds(cfg: Config, step: int) -> list[tuple[int, int]]:
    """(env seed, group id) per episode of ``step``: each group replays one seed.

    Seeds stay below ``eval.seed_offset``, so training never sees a held-out task.
    """
    groups = cfg.rollout.groups_per_step
    base = (cfg.run.seed * 7919 + step * groups) % cfg.eval.seed_offset
    return [((base + g) % cfg.eval.seed_offset, g)
            for g in range(groups) for _ in range(cfg.rollout.group_size)]


RESUMABLE = ("run.steps", "run.progress")
"""Config keys a resumed run may change; anything else would silently change the run."""
_PER_RUN_FILES = ("metrics.jsonl", "eval_before.json", "eval_before.jsonl", "eval_after.json",
                  "eval_after.jsonl", "summary.txt")


def prepare_run_dir(cfg: Config, resume: bool) -> tuple[Config, Path | None]:
    """Create or reopen the run directory; return the config to run and the checkpoint."""
    if not cfg.run.out_dir:
        if resume:
            raise ConfigError("--resume needs --run.out_dir RUN_DIR, the run to continue")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        cfg = replace(cfg, run=replace(cfg.run, out_dir=f"runs/{cfg.env.name}-{stamp}"))
    run_dir = Path(cfg.run.out_dir)
    checkpoint = latest_checkpoint(run_dir)
    saved = run_dir / "config.yaml"
    if resume:
        if not saved.exists():
            raise ConfigError(f"nothing to resume in '{run_dir}' (no config.yaml); "
                              "drop --resume to start a new run")
        stored = config_from_dict(yaml.safe_load(saved.read_text()))
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
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, saved)
    return cfg, checkpoint if resume else None


@dataclass
class Policy:
    """The model and everything that plays it: shared by ``train`` and ``turnrl eval``."""

    model: torch.nn.Module
    tokenizer: object
    chat: ChatFormat
    engine: HFEngine
    max_context: int | None
    run_eval: Callable[[], tuple[EvalResult, list]]
    """Plays the held-out seeds ``eval.seed_offset ...`` once with the current weights."""


def load_policy(cfg: Config) -> Policy:
    """Load the model on its device, check its chat template and the env, wire evaluation."""
    model, tokenizer = load_model(cfg.model.name, dtype=cfg.model.dtype,
                                  cache_dir=cfg.model.cache_dir or None)
    model.to(resolve_device(cfg.model.device))
    chat = ChatFormat(tokenizer)
    chat.check()  # fail at start-up, not mid-run, if the template breaks token-in-token-out
    make = partial(make_env, cfg.env.name, **cfg.env.options)
    make()  # bad env name or options fail here with a one-line error
    engine = HFEngine(model, tokenizer.pad_token_id, seed=cfg.run.seed,
                      reuse_cache=cfg.rollout.reuse_cache)
    eval_params = SamplingParams(cfg.rollout.max_new_tokens, cfg.eval.temperature,
                                 cfg.rollout.top_p, stop_token_ids=(chat.end_of_turn,))
    eval_seeds = list(range(cfg.eval.seed_offset, cfg.eval.seed_offset + cfg.eval.episodes))
    max_context = getattr(model.config, "max_position_embeddings", None)
    run_eval = partial(evaluate, make, eval_seeds, engine, chat, eval_params,
                       env_name=cfg.env.name, max_turns=cfg.rollout.max_turns,
                       env_timeout_s=cfg.rollout.env_timeout_s, max_context=max_context)
    return Policy(model, tokenizer, chat, engine, max_context, run_eval)


def update_settings(cfg: Config, model: torch.nn.Module) -> UpdateSettings:
    """The update's knobs from the config; the memory budget becomes a token budget."""
    budget = cfg.optim.memory_budget_mb * 2**20
    dtype_bytes = torch.finfo(next(model.parameters()).dtype).bits // 8
    return UpdateSettings(
        cfg.algo, cfg.optim, cfg.rollout.temperature,
        agg_constant=cfg.algo.loss_agg_constant
        or cfg.rollout.max_new_tokens * cfg.rollout.max_turns,
        token_budget=budget // activation_bytes_per_token(model.config, dtype_bytes))


def train(cfg: Config, *, resume: bool = False) -> TrainResult:
    cfg, checkpoint = prepare_run_dir(cfg, resume)
    run_dir = Path(cfg.run.out_dir)
    configure_torch(cfg.run.threads)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)

    policy = load_policy(cfg)
    model, tokenizer, chat, engine = policy.model, policy.tokenizer, policy.chat, policy.engine
    make = partial(make_env, cfg.env.name, **cfg.env.options)
    params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                            cfg.rollout.top_p, stop_token_ids=(chat.end_of_turn,))
    ref_model = copy.deepcopy(model).eval() if cfg.algo.kl_coef > 0 else None
    optimizer = make_optimizer(model, cfg.optim)
    settings = update_settings(cfg, model)
    credit = (TurnCredit(cfg.algo, model.config.hidden_size, seed=cfg.run.seed)
              if is_turn_level(cfg.algo.advantage) else None)

    start_step = 0
    if checkpoint is not None:
        state, rng = load_checkpoint(checkpoint, model, optimizer)
        restore_rng(rng, engine.generator)
        start_step = engine.version = state["step"]
        if credit is not None and (saved := load_component(checkpoint, "credit")) is not None:
            credit.load_state_dict(saved)
        print(f"resuming {run_dir} from step {start_step}")
    else:
        print(f"run directory: {run_dir}")
    # Steps logged after the checkpoint (or by a run that never checkpointed) are redone.
    truncate_metrics(run_dir / "metrics.jsonl", after_step=start_step)

    before = _load_or_run_eval(run_dir / "eval_before", policy.run_eval, cfg.eval.episodes)
    # run.tensorboard means "when installed": no warning on machines without it.
    tensorboard = cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is not None
    logger = MetricsLogger(run_dir, tensorboard=tensorboard, wandb=cfg.run.wandb,
                           wandb_project=cfg.run.wandb_project, config=config_to_dict(cfg))
    episodes_dir = run_dir / "episodes"
    episodes_dir.mkdir(exist_ok=True)

    with logger, TrainProgress(cfg.run.steps, start_step=start_step, enabled=cfg.run.progress,
                               description=f"{cfg.env.name}", length_unit="turns") as progress:
        for step in range(start_step, cfg.run.steps):
            timer = StageTimer()
            step_start = time.perf_counter()
            with timer("collect"):
                episodes = run_sync(run_episodes(
                    make, training_seeds(cfg, step), engine, chat, params,
                    env_name=cfg.env.name, max_turns=cfg.rollout.max_turns,
                    max_context=policy.max_context,
                    env_timeout_s=cfg.rollout.env_timeout_s))
            with timer("score"):
                rewards = torch.tensor([ep.reward for ep in episodes], dtype=torch.float32)
                groups = torch.tensor([ep.group for ep in episodes])
            with timer("advantages"):  # turn-level credit may also train its critic here
                advantages = (credit.advantages(model, episodes, tokenizer.pad_token_id)
                              if credit is not None
                              else compute_advantages(cfg.algo.advantage, rewards, groups))
                batch = Batch.from_episodes(episodes, advantages, tokenizer.pad_token_id)
            with timer("update"):
                update_metrics = policy_update(model, optimizer, batch, settings, ref_model)
                engine.version += 1
            with timer("log"):
                summary, metrics = episode_metrics(episodes)
                metrics.update(update_metrics)
                metrics.update(credit.metrics() if credit is not None else {})
                if cfg.run.sample_episodes:
                    write_episodes(episodes_dir / f"step-{step + 1:06d}.jsonl",
                                   episodes[:cfg.run.sample_episodes])
            metrics.update(periodic_eval(cfg, policy, step))
            metrics.update({f"time/{k}_s": v for k, v in timer.seconds.items()})
            metrics["time/step_s"] = time.perf_counter() - step_start
            logger.log(step + 1, metrics)
            progress.update(step + 1, reward=summary.mean_reward, turns=summary.mean_turns,
                            success=f"{summary.success_rate:.0%}")
            last = step + 1 == cfg.run.steps
            if last or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
                save_checkpoint(run_dir, step + 1, model, optimizer,
                                rng=rng_state(engine.generator), keep=cfg.run.keep_checkpoints,
                                components=None if credit is None else {"credit": credit.state_dict()})

    after = _load_or_run_eval(run_dir / "eval_after", policy.run_eval, cfg.eval.episodes,
                              fresh=True)
    table = before_after_table(cfg, run_dir, before, after)
    return TrainResult(run_dir, cfg.run.steps, before, after, table)


def episode_metrics(episodes: list) -> tuple[EvalResult, dict[str, float]]:
    """What a step's episodes say: reward, success, length (shared by sync and async)."""
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
    }


def periodic_eval(cfg: Config, policy: Policy, step: int) -> dict[str, float]:
    """Held-out metrics every ``eval.every`` steps (the last step gets the 'after' table)."""
    if not cfg.eval.every or (step + 1) % cfg.eval.every or step + 1 >= cfg.run.steps:
        return {}
    result, _ = policy.run_eval()
    lo, hi = result.interval
    return {"eval/success": result.success_rate, "eval/success_lo": lo,
            "eval/success_hi": hi, "eval/reward": result.mean_reward}


def before_after_table(cfg: Config, run_dir: Path, before: EvalResult | None,
                       after: EvalResult | None) -> str:
    """Print and save (summary.txt) the before/after table; '' without evaluation."""
    if not (before and after):
        return ""
    title = f"{cfg.env.name}: {cfg.eval.episodes} held-out episodes, before vs after"
    table = print_table(title, COLUMNS,
                        [before.row("before"), after.row(f"after {cfg.run.steps} steps")])
    (run_dir / "summary.txt").write_text(table)
    return table


def _load_or_run_eval(path: Path, run_eval, episodes: int, fresh: bool = False
                      ) -> EvalResult | None:
    """Evaluate once and keep the result (a resumed run does not re-measure 'before')."""
    if episodes == 0:
        return None
    result_file = path.with_suffix(".json")
    if result_file.exists() and not fresh:
        data = json.loads(result_file.read_text())
        return EvalResult(**{k: data[k] for k in ("episodes", "successes", "mean_reward",
                                                  "mean_turns", "failed")})
    result, eps = run_eval()
    write_episodes(path.with_suffix(".jsonl"), eps)
    tmp = result_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_dict()))
    tmp.replace(result_file)
    return result
