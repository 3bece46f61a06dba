"""The SFT warm-up stage of ``turnrl train`` (``sft.steps`` > 0): supervised fine-tuning in
``RUN_DIR/sft`` first, then RL from its last checkpoint, so RL starts from a model that
sometimes succeeds (a policy that never does gets zero reward and learns nothing).

The stage is an ordinary ``turnrl sft`` run (its own config.yaml, metrics, checkpoints), so
``--resume`` continues whichever stage was interrupted: an unfinished warm-up resumes bit for
bit, then RL starts; a finished one is not run again and RL resumes from its checkpoint.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from turnrl.checkpoint import latest_checkpoint
from turnrl.config import Config
from turnrl.models import checkpoint_base
from turnrl.sft.train import sft
from turnrl.trainer.run import with_out_dir


def warm_up(cfg: Config, *, resume: bool = False) -> tuple[Config, bool]:
    """Run the warm-up stage ``cfg.sft`` asks for; return the config RL runs with (its
    ``model.name`` the warm-up's last checkpoint) and whether RL resumes (a resumed run
    whose RL stage never started starts it). Without ``sft.steps``: ``cfg``, ``resume``."""
    if not cfg.sft.steps:
        return cfg, resume
    cfg = with_out_dir(cfg, resume)
    stage_dir = Path(cfg.run.out_dir) / "sft"
    last = stage_dir / "checkpoints" / f"step-{cfg.sft.steps:06d}"
    stage = stage_config(cfg, stage_dir, last)
    done = resume and last.is_dir()
    if not done and resume and latest_checkpoint(cfg.run.out_dir) is not None:
        raise FileNotFoundError(f"RL checkpoints in '{cfg.run.out_dir}' but no finished SFT "
                                f"warm-up at '{last}': start a new run directory")
    if not done:
        print(f"sft warm-up: {cfg.sft.steps} steps in {stage.run.out_dir}")
        sft(stage, resume=resume and (Path(stage.run.out_dir) / "config.yaml").exists())
    rl_resume = resume and (Path(cfg.run.out_dir) / "config.yaml").exists()
    return replace(cfg, model=replace(cfg.model, name=str(last))), rl_resume


def stage_config(cfg: Config, stage_dir: Path, last: Path) -> Config:
    """The warm-up's own run: ``stage_dir``, ``sft.steps`` steps at ``sft.lr`` (else
    optim.lr), from the model ``turnrl train`` was given; a resumed RL run's saved config
    names the warm-up's last checkpoint, which stands for the model the warm-up started from."""
    name = cfg.model.name
    if Path(name) == last:
        name = checkpoint_base(name) or name
    return replace(
        cfg, model=replace(cfg.model, name=name),
        run=replace(cfg.run, out_dir=str(stage_dir), steps=cfg.sft.steps),
        optim=replace(cfg.optim, lr=cfg.sft.lr or cfg.optim.lr))
