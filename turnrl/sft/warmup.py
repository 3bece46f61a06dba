"""The SFT warm-up stage of ``turnrl train`` (``sft.steps`` > 0): supervised fine-tuning in
``RUN_DIR/sft`` first, then RL from its last checkpoint, so RL starts from a model that
sometimes succeeds (a policy that never does gets zero reward and learns nothing).

The stage is an ordinary ``turnrl sft`` run (its own config.yaml, metrics, checkpoints), so
``--resume`` continues whichever stage was interrupted: an unfinished warm-up resumes bit for
bit, then RL starts; a finished one is not run again and RL resumes from its checkpoint.

With ``sft.self_rounds`` the stage is self-imitation rounds (sft/self_imitation.py); a round
with no success stops the stage early, and RL starts from the model as it then is (the
model given, when the first round already found nothing).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from turnrl.checkpoint import latest_checkpoint
from turnrl.config import Config, ConfigError
from turnrl.models import checkpoint_base
from turnrl.sft.self_imitation import check_rounds, stopped_at
from turnrl.sft.train import sft
from turnrl.trainer.run import with_out_dir


def warm_up(cfg: Config, *, resume: bool = False) -> tuple[Config, bool]:
    """Run the warm-up stage ``cfg.sft`` asks for; return the config RL runs with (its
    ``model.name`` the warm-up's last checkpoint) and whether RL resumes (a resumed run
    whose RL stage never started starts it). Without ``sft.steps``: ``cfg``, ``resume``."""
    if not cfg.sft.steps:
        if cfg.sft.self_rounds:
            raise ConfigError("sft.self_rounds in turnrl train is a warm-up stage: give it "
                              "steps with --sft.steps N (divided over the rounds)")
        return cfg, resume
    check_rounds(cfg.sft.self_rounds, cfg.sft.steps, "the warm-up (sft.steps)")
    cfg = with_out_dir(cfg, resume)
    stage_dir = Path(cfg.run.out_dir) / "sft"
    last = stage_dir / "checkpoints" / f"step-{cfg.sft.steps:06d}"
    stage = stage_config(cfg, stage_dir, last)
    done = resume and (last.is_dir() or stopped_at(stage_dir) is not None)
    if not done and resume and latest_checkpoint(cfg.run.out_dir) is not None:
        raise FileNotFoundError(f"RL checkpoints in '{cfg.run.out_dir}' but no finished SFT "
                                f"warm-up at '{last}': start a new run directory")
    if not done:
        print(f"sft warm-up: {cfg.sft.steps} steps in {stage.run.out_dir}")
        sft(stage, resume=resume and (Path(stage.run.out_dir) / "config.yaml").exists())
    rl_resume = resume and (Path(cfg.run.out_dir) / "config.yaml").exists()
    start = rl_start(stage_dir, stage.model.name, last)
    return replace(cfg, model=replace(cfg.model, name=start)), rl_resume


def rl_start(stage_dir: Path, given: str, last: Path) -> str:
    """The model RL starts from: the warm-up's last checkpoint, or where self-imitation
    stopped (the model given, when it stopped before its first step)."""
    step = stopped_at(stage_dir)
    if step is None:
        return str(last)
    where = "the model given" if step == 0 else f"its step-{step} checkpoint"
    print(f"sft warm-up: the self-imitation rounds stopped at step {step} of "
          f"{last.name.removeprefix('step-').lstrip('0')}; RL starts from {where}")
    return given if step == 0 else str(stage_dir / "checkpoints" / f"step-{step:06d}")


def stage_config(cfg: Config, stage_dir: Path, last: Path) -> Config:
    """The warm-up's own run: ``stage_dir``, ``sft.steps`` steps at ``sft.lr`` (else
    optim.lr), from the model ``turnrl train`` was given; a resumed RL run's saved config
    names the warm-up's last checkpoint, which stands for the model the warm-up started from."""
    name = cfg.model.name
    if Path(name).parent == last.parent:  # the last one or where self-imitation stopped
        name = checkpoint_base(name) or name
    return replace(
        cfg, model=replace(cfg.model, name=name),
        run=replace(cfg.run, out_dir=str(stage_dir), steps=cfg.sft.steps),
        optim=replace(cfg.optim, lr=cfg.sft.lr or cfg.optim.lr))
