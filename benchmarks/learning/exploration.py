"""Exploration options against plain GRPO on a task the starting policy rarely solves (CPU).

Task. guess-number 1..30 with 5 guesses: bisection needs all 5, so one wasted or garbled
turn loses the game. The starting policy is the tiny built-in model (154k parameters)
warmed up by imitating the scripted bisection player with 30% of its moves replaced by a
wasted turn (``benchmarks/learning/warmup.py``, as ``benchmarks/learning/credit_assignment.py`` does), so
sampled at temperature 1 it solves few games (pass@1 low) and a larger share once in 8
tries (pass@8).

Methods, each from the same warmed-up model with the same lr, group size, groups per step,
steps and seeds; every option at the value its paper uses or its documented default,
chosen before any run (nothing here was tuned on the results):

- ``grpo``: plain GRPO: symmetric clip 0.2, per-sequence mean loss (the DeepSeekMath form);
- ``dapo``: the DAPO set: clip-higher 0.28, dynamic sampling (up to 3 extra rounds a step),
  soft overlong punishment (buffer: a quarter of the token budget), token-level loss;
- ``high_entropy``: plain GRPO, policy gradient only on the top 20% entropy tokens
  (Wang et al. 2025);
- ``novelty``: plain GRPO plus the count-based state-novelty bonus, beta 0.1, over the env's
  hashed state (the feasible interval).

Measured per run: pass@1 and pass@8 on held-out games (the unbiased estimator of Chen et al.
2021 from 8 samples per game), before and after training, and the policy entropy of every
step. Intervals: 95% normal intervals over the held-out games, pooled over seeds.

Usage::

    python benchmarks/learning/exploration.py --out runs/exploration          # 4 methods x 3 seeds
    python benchmarks/learning/exploration.py --quick --out /tmp/explore        # smoke test

The last line is ``ratio: best option / grpo pass@8 = X``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from warm_tasks import Settings, Task, run_warmup  # noqa: E402

TASK = Task("guess-number", {"low": 1, "high": 30, "max_turns": 5}, max_turns=5,
            max_new_tokens=4, noise=0.3, noise_kind="wasted", warmup_steps=200, steps=16,
            eval_every=0, notes="hidden integer in 1..30, 5 guesses (bisection needs all 5)")
NAME = "guess-number-5"

METHODS: dict[str, list[str]] = {
    "grpo": ["--algo.clip_high", "0.2", "--algo.loss_agg", "seq_mean_token_mean"],
    "dapo": ["--algo.clip_high", "0.28", "--algo.loss_agg", "token_mean",
             "--explore.dynamic_sampling", "true", "--explore.dynamic_max_rounds", "3",
             "--explore.overlong_buffer", "5"],
    "high_entropy": ["--algo.clip_high", "0.2", "--algo.loss_agg", "seq_mean_token_mean",
                     "--explore.top_entropy_fraction", "0.2"],
    "novelty": ["--algo.clip_high", "0.2", "--algo.loss_agg", "seq_mean_token_mean",
                "--explore.novelty_coef", "0.1"],
}
K = 8


@dataclass(frozen=True)
class EvalPlan:
    games: int = 32
    """held-out games per seed, each played K times"""


def run_args(method: str, seed: int, steps: int, settings: Settings, model_dir: str,
             run_dir: str) -> list[str]:
    return [
        "--model.name", model_dir, "--model.device", "cpu",
        "--env.name", TASK.env, "--env.options", json.dumps(TASK.options),
        "--rollout.group_size", str(settings.group_size),
        "--rollout.groups_per_step", str(settings.groups_per_step),
        "--rollout.max_turns", str(TASK.max_turns),
        "--rollout.max_new_tokens", str(TASK.max_new_tokens),
        "--optim.lr", str(settings.lr), "--eval.episodes", "0",
        "--eval.seed_offset", str(1_000_000 + 100_000 * seed),
        "--run.steps", str(steps), "--run.seed", str(seed), "--run.out_dir", run_dir,
        "--run.threads", str(settings.threads), "--run.checkpoint_every", "0",
        "--run.keep_checkpoints", "1", "--run.sample_episodes", "0",
        "--run.progress", "false", "--run.tensorboard", "false",
        *METHODS[method],
    ]


def pass_at_k_per_game(cfg, model, tokenizer, games: int) -> list[list[int]]:
    """[successes of K samples] per held-out game, with the model as it is now."""
    from functools import partial

    from turnrl.envs import make_env
    from turnrl.evaluation import evaluate
    from turnrl.rollout import ChatFormat
    from turnrl.rollout.chat import sampling_params
    from turnrl.samplers import HFEngine

    chat = ChatFormat(tokenizer)
    engine = HFEngine(model, tokenizer.pad_token_id, seed=cfg.run.seed + 17)
    seeds = [cfg.eval.seed_offset + g for g in range(games) for _ in range(K)]
    _, episodes = evaluate(partial(make_env, cfg.env.name, **cfg.env.options), seeds, engine,
                           chat, sampling_params(cfg, chat, 1.0), env_name=cfg.env.name,
                           max_turns=cfg.rollout.max_turns,
                           max_context=getattr(model.config, "max_position_embeddings", None))
    return [[int(ep.success) for ep in episodes[g * K:(g + 1) * K]] for g in range(games)]


def run_one(method: str, seed: int, steps: int, settings: Settings, plan: EvalPlan,
            model_dir: str, run_dir: str) -> dict:
    """Train one (method, seed); evaluate pass@1/pass@8 before and after."""
    import torch

    from turnrl.checkpoint import latest_checkpoint, load_checkpoint
    from turnrl.config import load_config
    from turnrl.metrics import read_metrics
    from turnrl.models import load_model
    from turnrl.trainer import train
    from turnrl.trainer.step import make_optimizer

    torch.set_num_threads(settings.threads)
    cfg = load_config(None, run_args(method, seed, steps, settings, model_dir, run_dir))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model, tokenizer = load_model(model_dir)
    # The starting policy's pass@k, once per seed (every method starts from it).
    before = pass_at_k_per_game(cfg, model, tokenizer, plan.games) if method == "grpo" else []
    with open(Path(run_dir) / "train.log", "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        train(cfg)
    load_checkpoint(latest_checkpoint(run_dir), model, make_optimizer(model, cfg.optim))
    after = pass_at_k_per_game(cfg, model, tokenizer, plan.games)
    records = read_metrics(Path(run_dir) / "metrics.jsonl")
    return {"method": method, "seed": seed, "steps": steps,
            "wall_s": time.perf_counter() - start, "before": before, "after": after,
            "entropy": [r.get("entropy") for r in records],
            "train_success": [r.get("success/rate") for r in records],
            "episodes_trained": sum(settings.group_size * r.get("dynamic/collected_groups",
                                                                settings.groups_per_step)
                                    for r in records),
            "warnings": sorted({k for r in records for k, v in r.items()
                                if k.startswith("warn/") and v})}


# ---- analysis --------------------------------------------------------------------------------


def passk_values(games: list[list[int]], k: int) -> list[float]:
    from turnrl.stats import pass_at_k

    return [pass_at_k(len(g), sum(g), k) for g in games]


def fmt(values: list[float]) -> str:
    from turnrl.stats import mean_interval

    mean, lo, hi = mean_interval(values)
    return f"{100 * mean:.1f}% [{100 * max(lo, 0):.1f}, {100 * min(hi, 1):.1f}]"


def analyse(results: list[dict]) -> tuple[list[str], dict]:
    lines, summary = [], {}
    base = [g for r in results for g in r["before"]]
    lines.append(f"starting policy (held-out games of the grpo runs, {len(base)} games x {K}): "
                 f"pass@1 {fmt(passk_values(base, 1))}, pass@{K} {fmt(passk_values(base, K))}")
    lines.append(f"{'method':<13} {'seeds':>5} {'pass@1 [95% CI]':<22} {'pass@8 [95% CI]':<22} "
                 f"{'entropy start -> end':<21} {'episodes':>8}  warnings")
    for method in METHODS:
        runs = sorted((r for r in results if r["method"] == method), key=lambda r: r["seed"])
        if not runs:
            continue
        games = [g for r in runs for g in r["after"]]
        p1, pk = passk_values(games, 1), passk_values(games, K)
        e0 = statistics.mean(r["entropy"][0] for r in runs)
        e1 = statistics.mean(r["entropy"][-1] for r in runs)
        episodes = statistics.mean(r["episodes_trained"] for r in runs)
        warned = sorted({w for r in runs for w in r["warnings"]})
        summary[method] = {"pass@1": statistics.mean(p1), f"pass@{K}": statistics.mean(pk),
                           "entropy_start": e0, "entropy_end": e1, "episodes": episodes,
                           "wall_s": sum(r["wall_s"] for r in runs)}
        lines.append(f"{method:<13} {len(runs):>5} {fmt(p1):<22} {fmt(pk):<22} "
                     f"{e0:>8.3f} -> {e1:<8.3f} {episodes:>10.0f}  {','.join(warned) or '-'}")
    if "grpo" in summary:
        g = summary["grpo"]
        for method, s in summary.items():
            if method != "grpo":
                lines.append(f"{method} / grpo: pass@1 x{s['pass@1'] / max(g['pass@1'], 1e-9):.2f}"
                             f", pass@{K} x{s[f'pass@{K}'] / max(g[f'pass@{K}'], 1e-9):.2f}, "
                             f"final entropy x{s['entropy_end'] / max(g['entropy_end'], 1e-9):.2f}")
        others = {m: s[f"pass@{K}"] for m, s in summary.items() if m != "grpo"}
        if others:
            best = max(others, key=others.get)
            lines.append(f"ratio: best option ({best}) / grpo pass@{K} = "
                         f"{others[best] / max(g[f'pass@{K}'], 1e-9):.2f}")
    return lines, summary


def entropy_table(results: list[dict]) -> list[str]:
    """Mean entropy over seeds at a few steps of training."""
    lines = []
    for method in METHODS:
        runs = [r for r in results if r["method"] == method]
        if not runs:
            continue
        steps = len(runs[0]["entropy"])
        marks = sorted({0, steps // 4, steps // 2, 3 * steps // 4, steps - 1})
        cells = [f"{m + 1}:{statistics.mean(r['entropy'][m] for r in runs):.3f}" for m in marks]
        lines.append(f"entropy by step, {method:<13} " + "  ".join(cells))
    return lines


# ---- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/exploration")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=TASK.steps)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true", help="smoke test: 2 steps, 1 seed, 4 games")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            sys.exit(f"unknown method '{m}'; choose from {', '.join(METHODS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings, plan, task, seeds, steps = Settings(), EvalPlan(), TASK, args.seeds, args.steps
    if args.quick:
        settings = replace(settings, group_size=4, groups_per_step=2)
        plan, task, seeds, steps = EvalPlan(games=4), replace(TASK, warmup_steps=10), 1, 2
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start",
          flush=True)
    start = time.perf_counter()
    results: list[dict] = []
    ctx = get_context("spawn")  # fresh interpreters: no torch thread pools across a fork
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        warm = pool.submit(run_warmup, str(out), NAME, task, settings).result()
        print(f"warm-up: {warm['dir']} (loss {warm['final_loss']:.3f}, {warm['wall_s']:.0f} s)",
              flush=True)
        pending = {pool.submit(run_one, m, s, steps, settings, plan, warm["dir"],
                               str(out / "runs" / m / f"seed{s}"))
                   for m in methods for s in range(seeds)}
        while pending:
            ready, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in ready:
                r = future.result()
                results.append(r)
                (out / "results.json").write_text(json.dumps({"runs": results}) + "\n")
                print(f"[{len(results)}/{len(methods) * seeds}] {r['method']} seed {r['seed']}: "
                      f"pass@1 {statistics.mean(passk_values(r['after'], 1)):.2f}, pass@{K} "
                      f"{statistics.mean(passk_values(r['after'], K)):.2f}, wall "
                      f"{r['wall_s']:.0f} s; elapsed {time.perf_counter() - start:.0f} s",
                      flush=True)
    lines, summary = analyse(results)
    lines = entropy_table(results) + lines
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{seeds} seeds x {steps} steps x {settings.group_size * settings.groups_per_step} "
          f"episodes/step, lr {settings.lr}; total wall {time.perf_counter() - start:.0f} s, "
          f"load {os.getloadavg()[0]:.1f} at end, {os.cpu_count()} cores")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
