"""What follows each step and the run, whatever the source: logs, samples, checkpoints.

``step_logging`` opens the metrics logger (metrics.jsonl; TensorBoard, W&B, Trackio, MLflow:
``turnrl/tracking.py``) and the progress bar; ``end_step`` does what follows every step (sample episodes, the periodic held-out
evaluation, metrics, progress, an atomic checkpoint of the model, optimiser, every random
stream, the estimator and exploration state); ``finish_run`` prints (and saves) the
before/after table. Set-up is ``trainer/run.py``'s; the held-out evaluation itself,
``trainer/evaluation.py``'s.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from turnrl.checkpoint import rng_state, save_checkpoint
from turnrl.config import config_to_dict
from turnrl.evaluation import COLUMNS, EvalResult, whole_games
from turnrl.metrics import MetricsLogger, TrainProgress, print_table
from turnrl.trainer.evaluation import periodic_eval, write_transcripts
from turnrl.trainer.reference import frozen_reference
from turnrl.trainer.rl_step import Learner, StageTimer
from turnrl.trainer.run import Run
from turnrl.types import Episode, write_episodes


@dataclass
class TrainResult:
    """What a run leaves: its directory, steps, the before/after evaluations and table."""

    run_dir: Path
    steps: int
    before: EvalResult | None
    after: EvalResult | None
    table: str


@contextmanager
def step_logging(run: Run, description: str) -> Iterator[tuple[MetricsLogger, TrainProgress]]:
    """The metrics logger and the progress bar of the training loop."""
    cfg = run.cfg
    # run.tensorboard means "when installed": no warning on machines without it.
    tensorboard = cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is not None
    logger = MetricsLogger(run.run_dir, tensorboard=tensorboard, wandb=cfg.run.wandb,
                           wandb_project=cfg.run.wandb_project, config=config_to_dict(cfg),
                           tracking=cfg.run.trackers(), metrics_port=cfg.run.metrics_port)
    (run.run_dir / "episodes").mkdir(exist_ok=True)
    with logger, TrainProgress(cfg.run.steps, start_step=run.start_step,
                               enabled=cfg.run.progress, description=description,
                               length_unit="turns") as progress:
        yield logger, progress


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
                        frozen={**(checkpoint_frozen or {}), **frozen_reference(
                            learner, step + 1, cfg.algo.reference_reset_every)},
                        components={"estimator": learner.estimator.state_dict(),
                                    "exploration": learner.explore.state_dict(),
                                    **({"replay": learner.replay.state_dict()}
                                       if learner.replay is not None else {})},
                        **sharded_weights(learner))


def sharded_weights(learner: Learner) -> dict[str, Callable[[Path], None]]:
    """With learner ranks, ``save_checkpoint``'s ``weights``: how a checkpoint's model and
    optimiser state is written, every rank its part of one torch.distributed.checkpoint
    directory ({} in one process: today's files)."""
    world = learner.world
    if world is None:
        return {}
    from turnrl.learner.checkpoints import save_sharded

    def write(directory: Path) -> None:
        world.command("save", directory)
        save_sharded(directory, learner.model, learner.optimizer)

    return {"weights": write}


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
            if f"{key}_lo" in measured:  # a per-role rate (selfplay.role_outcomes)
                line += f" [95% CI {measured[f'{key}_lo']:.4f}, {measured[f'{key}_hi']:.4f}]"
            print(line)
            table += line + "\n"
        (run.run_dir / "summary.txt").write_text(table)
    return TrainResult(run.run_dir, run.cfg.run.steps, before, after, table)
