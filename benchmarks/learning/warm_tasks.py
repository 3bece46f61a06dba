"""A benchmark task that starts RL from an imitation warm-up, and the settings every compared
method shares. Used by ``benchmarks/learning/exploration.py`` (formerly part of the credit-assignment
benchmark, which now runs its own ``key-corridor`` task)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Task:
    env: str
    options: dict
    max_turns: int
    """policy turns per episode (the environment's own limit)"""
    max_new_tokens: int
    """enough for the longest move plus the end-of-turn token"""
    noise: float
    """warm-up: probability that a demonstrated move is replaced by a noise move"""
    noise_kind: str
    """warm-up: "random" (a random legal move) or "wasted" (a move that changes nothing)"""
    warmup_steps: int
    """imitation steps of the warm-up (batch 16, lr 3e-3, 512 noisy demonstrations)"""
    steps: int
    """RL steps (the episode budget is steps x episodes per step)"""
    eval_every: int
    """evaluate on held-out seeds every this many steps"""
    notes: str = ""


@dataclass(frozen=True)
class Settings:
    """Shared by every compared method: the fairness knobs."""

    lr: float = 1e-4
    group_size: int = 8
    groups_per_step: int = 8
    eval_episodes: int = 64
    threads: int = 1
    extra: tuple[str, ...] = field(default_factory=tuple)
    """further ``--section.key value`` overrides applied to every run"""


def episodes_per_step(s: Settings) -> int:
    return s.group_size * s.groups_per_step


def warm_dir(out: Path, name: str, task: Task) -> Path:
    return out / "warmup" / f"{name}-{task.noise_kind}{task.noise}-steps{task.warmup_steps}"


def run_warmup(out: str, name: str, task: Task, settings: Settings) -> dict:
    """Warm a tiny model up on the task's noisy demonstrations (reused when already there);
    its log goes to a file beside it. Runs in a worker process."""
    import torch
    from warmup import WarmupConfig, warm_start

    torch.set_num_threads(settings.threads)
    start, cpu = time.perf_counter(), time.process_time()
    wcfg = WarmupConfig(task.env, task.options, noise=task.noise, kind=task.noise_kind,
                        steps=task.warmup_steps)
    directory = warm_dir(Path(out), name, task)
    directory.parent.mkdir(parents=True, exist_ok=True)
    log_path = directory.parent / f"{directory.name}.log"
    with open(log_path, "a") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        directory, info = warm_start(directory, wcfg, log=print)
    return {"task": name, "dir": str(directory), "wall_s": time.perf_counter() - start,
            "cpu_s": time.process_time() - cpu,
            "train_s": info["seconds"], "final_loss": info["final_loss"]}
