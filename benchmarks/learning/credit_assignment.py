"""Turn-level credit assignment vs outcome GRPO: a horizon sweep on a task built to need it.

Task: ``key-corridor`` (``turnrl/envs/credit_tasks.py``): pick one of two keys at turn 0, walk
filler turns where any reply is fine, and the door at the last turn opens only with the right
key; reward 1 on success, else 0. Only the key turn matters, so with more turns outcome-level
GRPO spreads the episode's one bit of credit over more turns that do not matter, while GiGPO
(anchor-state step groups), ArCHer (a TD-trained turn-level double-Q critic) and turn-level
PPO (GAE over turns with a learned V) can score the key turn alone. Horizons 4, 8 and 16.

Starting policy: the tiny random model (``--model.name tiny``, 154k parameters, a fresh random
model, the same for every run), whose replies pick a key by their first character's code
(mod 2). The right key is the one this model picks less often, measured at run time from 256
sampled first replies, so the start success is the lower of the two key rates.

Threshold (from the optimum, not from the runs): halfway from the start success (pooled
held-out evaluation before training, every run of that horizon) to the optimum, 100%. A run's
"episodes to threshold" is the training episodes at its first periodic evaluation at or above
it; a run that never gets there counts as the whole budget (a censored value, marked ">").
Per method: the mean over seeds with a 95% t interval.

Fairness: every method gets the same lr, group size, groups per step, steps, evaluation; the
per-method knobs are the frozen ``METHOD_SETTINGS``, chosen by ``--tune`` on tuning seeds
(100) disjoint from the measurement seeds (0..4), with the same grid size per method
(``TUNE_GRID``) at horizon 16; see docs/credit_assignment.md for the tuning run and its table.

Usage::

    python benchmarks/learning/credit_assignment.py --out DIR           # 3 horizons x 5 methods x 5 seeds
    python benchmarks/learning/credit_assignment.py --tune --out DIR     # the per-method tuning grid
    python benchmarks/learning/credit_assignment.py --quick --out DIR    # smoke test

Raw per-run curves go to ``--out``/results.json (``--report-only`` recomputes the table and
figure from it); finished runs found there with the same arguments are reused, not rerun.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

METHODS = ("grpo", "gigpo", "archer", "turn_gae", "token_gae")
HIERARCHICAL = ("gigpo", "archer", "turn_gae")
"""The turn-level (hierarchical) credit methods; ``grpo`` is the outcome-level baseline and
``token_gae`` (PPO with a token-level critic, ``--methods`` names it) the token-level one."""
HORIZONS = (4, 8, 16)
KEYS = 2

METHOD_SETTINGS: dict[str, tuple[str, ...]] = {
    # frozen from the --tune run at horizon 16 on seed 100 (docs/credit_assignment.md): the
    # best area under the curve per method (archer: four ties, the cheapest kept)
    "grpo": (),
    "gigpo": ("--critic.gigpo_step_weight", "1.0", "--critic.gigpo_episode_weight", "0"),
    "turn_gae": ("--critic.gae_lambda", "1.0", "--critic.lr", "1e-2",
                 "--critic.updates", "32"),
    "archer": ("--critic.lr", "3e-3", "--critic.updates", "16",
               "--critic.warmup_max_error", "0.5"),
    # not tuned: turn_gae's frozen critic settings (token_lambda 1 is token_gae's default)
    "token_gae": ("--critic.lr", "1e-2", "--critic.updates", "32"),
}
LAMBDA1 = ("--critic.gae_lambda", "1.0")
FAST_CRITIC = ("--critic.lr", "1e-2", "--critic.updates", "32")
GATE = ("--critic.warmup_max_error", "0.5")
TUNE_GRID: dict[str, list[tuple[str, ...]]] = {
    # four settings per turn-level method (the same budget each); grpo has no knob of its own
    "gigpo": [("--critic.gigpo_step_weight", "1.0"), ("--critic.gigpo_step_weight", "3.0"),
              ("--critic.gigpo_step_weight", "10.0"),
              ("--critic.gigpo_step_weight", "1.0", "--critic.gigpo_episode_weight", "0")],
    "turn_gae": [(*LAMBDA1, "--critic.lr", "3e-3", "--critic.updates", "16"),
                 (*LAMBDA1, *FAST_CRITIC),
                 (*LAMBDA1, *FAST_CRITIC, *GATE),
                 (*LAMBDA1, *FAST_CRITIC, *GATE, "--critic.scale", "running")],
    "archer": [("--critic.lr", "3e-3", "--critic.updates", "16", *GATE),
               (*FAST_CRITIC, *GATE),
               (*FAST_CRITIC, "--critic.tau", "0.3", *GATE),
               (*FAST_CRITIC, "--critic.tau", "0.3", *GATE, "--critic.scale", "running")],
}
TUNE_SEEDS, TUNE_HORIZON = (100,), 16


@dataclass(frozen=True)
class Settings:
    """Shared by every method: the fairness knobs."""

    lr: float = 1e-2
    group_size: int = 8
    groups_per_step: int = 4
    steps: int = 32
    eval_every: int = 4
    eval_episodes: int = 32
    threads: int = 1
    right_key: int = 0


def episodes_per_step(s: Settings) -> int:
    return s.group_size * s.groups_per_step


def measure_right_key(samples: int = 256) -> tuple[int, list[float]]:
    """The key the starting policy picks least often, and each key's measured rate."""
    import torch

    from turnrl.envs.credit_tasks import KeyCorridor, chosen_key
    from turnrl.models import tiny_model
    from turnrl.rollout import ChatFormat

    model, tokenizer = tiny_model(0)
    chat = ChatFormat(tokenizer)
    env = KeyCorridor(horizon=2, keys=KEYS)
    import asyncio
    first = asyncio.run(env.reset(0))
    _, _, ids = chat.start(first, env.system_prompt)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    generator = torch.Generator().manual_seed(0)
    draws = torch.multinomial(logits.softmax(-1), samples, replacement=True, generator=generator)
    counts = [0] * KEYS
    for token in draws.tolist():
        counts[chosen_key(tokenizer.decode([token]), KEYS)] += 1
    rates = [c / samples for c in counts]
    return min(range(KEYS), key=rates.__getitem__), rates


# ---- one run (in a worker process) -------------------------------------------------------------

def run_config_args(horizon: int, method: str, knobs: tuple[str, ...], seed: int,
                    s: Settings, run_dir: str) -> list[str]:
    options = json.dumps({"horizon": horizon, "keys": KEYS, "right_key": s.right_key})
    return [
        "--model.name", "tiny", "--model.device", "cpu",
        "--env.name", "key-corridor", "--env.options", options,
        "--rollout.group_size", str(s.group_size),
        "--rollout.groups_per_step", str(s.groups_per_step),
        "--rollout.max_turns", str(horizon), "--rollout.max_new_tokens", "2",
        "--algo.advantage", method, *knobs,
        "--optim.lr", str(s.lr),
        "--eval.episodes", str(s.eval_episodes), "--eval.every", str(s.eval_every),
        "--eval.seed_offset", str(1_000_000 + 100_000 * seed),
        "--run.steps", str(s.steps), "--run.seed", str(seed), "--run.out_dir", run_dir,
        "--run.threads", str(s.threads), "--run.checkpoint_every", "0",
        "--run.keep_checkpoints", "1", "--run.sample_episodes", "0",
        "--run.progress", "false", "--run.tensorboard", "false",
    ]


def run_one(key: tuple, args: list[str], s: Settings, run_dir: str) -> dict:
    """Train one run and return its held-out success curve; output goes to train.log."""
    from turnrl.config import load_config
    from turnrl.metrics import read_metrics
    from turnrl.trainer import train

    cfg = load_config(None, args)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    start, cpu = time.perf_counter(), time.process_time()
    with open(Path(run_dir) / "train.log", "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        result = train(cfg)
    per_step = episodes_per_step(s)
    records = read_metrics(Path(run_dir) / "metrics.jsonl")
    curve = [[0, result.before.successes, result.before.episodes]]
    curve += [[r["step"] * per_step, round(r["eval/success"] * s.eval_episodes),
               s.eval_episodes] for r in records if "eval/success" in r]
    in_use = [r["credit/critic_in_use"] for r in records if "credit/critic_in_use" in r]
    if curve[-1][0] != s.steps * per_step:
        curve.append([s.steps * per_step, result.after.successes, result.after.episodes])
    return {"key": list(key), "horizon": key[0], "method": key[1], "tag": key[2],
            "seed": key[3], "wall_s": time.perf_counter() - start,
            "cpu_s": time.process_time() - cpu, "curve": curve,
            "before": result.before.to_dict(), "after": result.after.to_dict(),
            "budget": s.steps * per_step, "args": args,
            "critic_in_use": sum(in_use) / len(in_use) if in_use else None}


# ---- analysis --------------------------------------------------------------------------------

T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% Student-t interval (normal beyond 10 values)."""
    from turnrl.stats import mean_interval

    return mean_interval(values, z=T_975.get(len(values) - 1, 1.96))


def threshold_for(runs: list[dict]) -> tuple[float, float]:
    """(threshold, pooled start success): halfway from the start to the optimum (100%)."""
    s = sum(r["before"]["successes"] for r in runs)
    n = sum(r["before"]["episodes"] for r in runs)
    return s / n + 0.5 * (1.0 - s / n), s / n


def episodes_to(run: dict, threshold: float) -> float:
    """Training episodes at the first evaluation (after step 0) at or above ``threshold``."""
    for episodes, successes, n in run["curve"][1:]:
        if successes / n >= threshold - 1e-9:
            return float(episodes)
    return math.inf


def summarise(results: list[dict], tag: str = "") -> tuple[list[str], dict]:
    lines, summary = [], {}
    for horizon in sorted({r["horizon"] for r in results}):
        runs = [r for r in results if r["horizon"] == horizon and r["tag"] == tag]
        if not runs:
            continue
        thr, start = threshold_for(runs)
        budget = max(r["budget"] for r in runs)
        lines.append(f"horizon {horizon}: start {start:.1%}, threshold {thr:.1%} (halfway to "
                     f"100%), budget {budget} episodes per run")
        lines.append(f"  {'method':<9} {'episodes to threshold: mean [95% CI]':<38} "
                     f"{'final success (pooled)':<24} per seed")
        summary[horizon] = {"threshold": thr, "start": start, "budget": budget, "methods": {}}
        for method in METHODS:
            mruns = sorted((r for r in runs if r["method"] == method), key=lambda r: r["seed"])
            if not mruns:
                continue
            raw = [episodes_to(r, thr) for r in mruns]
            censored = [min(v, budget) for v in raw]
            mean, lo, hi = t_interval(censored)
            lo, hi = max(lo, 0.0), min(hi, float(budget))  # episodes lie in [0, budget]
            after = (sum(r["after"]["successes"] for r in mruns),
                     sum(r["after"]["episodes"] for r in mruns))
            summary[horizon]["methods"][method] = {
                "mean": mean, "lo": lo, "hi": hi, "per_seed": raw,
                "final": after[0] / after[1], "cpu_s": sum(r["cpu_s"] for r in mruns)}
            from turnrl.stats import format_rate
            seeds = ", ".join(f">{budget}" if math.isinf(v) else f"{v:.0f}" for v in raw)
            used = [r["critic_in_use"] for r in mruns if r.get("critic_in_use") is not None]
            if used:  # the share of steps whose policy update used the critic (warm-up over)
                seeds += f"; critic used in {statistics.mean(used):.0%} of steps"
            lines.append(f"  {method:<9} {f'{mean:.0f} [{lo:.0f}, {hi:.0f}]':<38} "
                         f"{format_rate(*after):<24} {seeds}")
        lines.append("")
    return lines, summary


def ratio_lines(summary: dict) -> list[str]:
    """Best hierarchical / GRPO mean episodes to threshold, at each horizon; the last line is
    the longest horizon's."""
    lines, last = [], None
    for horizon, info in sorted(summary.items()):
        ms = info["methods"]
        hier = {m: v for m, v in ms.items() if m in HIERARCHICAL}
        if "grpo" not in ms or not hier:
            continue
        best = min(hier, key=lambda m: hier[m]["mean"])
        b, g = hier[best], ms["grpo"]
        apart = "do not overlap" if b["hi"] < g["lo"] or g["hi"] < b["lo"] else "overlap"
        last = b["mean"] / g["mean"]
        lines.append(f"horizon {horizon}: best hierarchical {best} {b['mean']:.0f} "
                     f"[{b['lo']:.0f}, {b['hi']:.0f}] vs grpo {g['mean']:.0f} "
                     f"[{g['lo']:.0f}, {g['hi']:.0f}] episodes: ratio {last:.2f}, "
                     f"intervals {apart}")
    if last is None:
        return ["ratio: needs grpo and a hierarchical method"]
    return [*lines, f"ratio: best hierarchical / grpo episodes to threshold = {last:.2f}"]


def plot(results: list[dict], summary: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    horizons = sorted(summary)
    fig = Figure(figsize=(5 * max(len(horizons), 1), 4))
    FigureCanvasAgg(fig)
    for i, horizon in enumerate(horizons):
        ax = fig.add_subplot(1, len(horizons), i + 1)
        for method in METHODS:
            runs = [r for r in results if r["horizon"] == horizon and r["method"] == method
                    and r["tag"] == ""]
            if not runs:
                continue
            xs = sorted({p[0] for r in runs for p in r["curve"]})
            stats = [t_interval([p[1] / p[2] for r in runs for p in r["curve"] if p[0] == x])
                     for x in xs]
            line, = ax.plot(xs, [m for m, _, _ in stats], marker="o", ms=3,
                            label=f"{method} ({len(runs)} seeds)")
            ax.fill_between(xs, [max(lo, 0) for _, lo, _ in stats],
                            [min(hi, 1) for _, _, hi in stats], color=line.get_color(),
                            alpha=0.12)
        ax.axhline(summary[horizon]["threshold"], color="grey", ls="--", lw=1,
                   label="threshold")
        ax.set_title(f"key-corridor, horizon {horizon}")
        ax.set_xlabel("training episodes")
        ax.set_ylabel("held-out success (mean of seeds, 95% t band)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def tune_lines(results: list[dict]) -> list[str]:
    """Per method and setting: mean held-out success over the tuning runs' evaluations (the
    area under the learning curve, the score that picks the setting to freeze), and for
    information the mean episodes to the threshold (censored at the budget)."""
    tuned = [r for r in results if r["tag"].startswith("tune") and r["seed"] in TUNE_SEEDS]
    if not tuned:
        return ["tuning: no results"]
    thr, start = threshold_for(tuned)
    lines = [f"tuning at horizon {TUNE_HORIZON}, seeds {list(TUNE_SEEDS)}: score = mean "
             f"held-out success over every evaluation (area under the curve); episodes to "
             f"{thr:.1%} (start {start:.1%})"]
    for method, grid in TUNE_GRID.items():
        scores = []
        for i, knobs in enumerate(grid):
            runs = [r for r in tuned if r["method"] == method and r["tag"] == f"tune{i}"]
            if runs:
                auc = statistics.mean(p[1] / p[2] for r in runs for p in r["curve"][1:])
                reach = statistics.mean(min(episodes_to(r, thr), r["budget"]) for r in runs)
                scores.append((auc, knobs))
                lines.append(f"  {method:<9} {' '.join(knobs):<84} {auc:.3f} {reach:5.0f} "
                             f"({len(runs)} runs)")
        if scores:
            lines.append(f"  {method:<9} best: {' '.join(max(scores)[1])}")
    return lines


# ---- main ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--horizons", default=",".join(map(str, HORIZONS)))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", type=int, default=5, help="measurement seeds 0..N-1")
    p.add_argument("--steps", type=int, default=Settings.steps, help="RL steps per run")
    p.add_argument("--out", default="runs/credit_assignment", help="output directory")
    p.add_argument("--tune", action="store_true", help="run the tuning grid instead")
    p.add_argument("--quick", action="store_true", help="smoke test: 3 steps, 1 seed, h 4")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="runs in parallel (processes, one torch thread each)")
    p.add_argument("--report-only", action="store_true",
                   help="recompute the table and figure from --out/results.json")
    return p.parse_args(argv)


def plan(args: argparse.Namespace, s: Settings, out: Path) -> list[tuple[tuple, list[str]]]:
    """(key, config args) of every run: key = (horizon, method, tag, seed)."""
    runs = []
    if args.tune:
        for method, grid in TUNE_GRID.items():
            for i, knobs in enumerate(grid):
                for seed in TUNE_SEEDS:
                    key = (TUNE_HORIZON, method, f"tune{i}", seed)
                    runs.append((key, knobs))
    else:
        methods = [m for m in args.methods.split(",") if m]
        for horizon in [int(h) for h in args.horizons.split(",") if h]:
            for method in methods:
                for seed in range(args.seeds):
                    runs.append(((horizon, method, "", seed), METHOD_SETTINGS[method]))
    return [(key, run_config_args(key[0], key[1], knobs, key[3], s,
                                  str(out / "runs" / f"h{key[0]}-{key[1]}{key[2]}-s{key[3]}")))
            for key, knobs in runs]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for m in args.methods.split(","):
        if m and m not in METHODS:
            sys.exit(f"unknown method '{m}'; choose from {', '.join(METHODS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    previous = json.loads(results_path.read_text()) if results_path.exists() else {"runs": []}
    if args.report_only:
        results = previous["runs"]
    else:
        right_key, rates = measure_right_key()
        print(f"start policy key rates {[f'{r:.1%}' for r in rates]}: right key {right_key}; "
              f"cpu_count {os.cpu_count()}, loadavg {os.getloadavg()}", flush=True)
        s = Settings(steps=args.steps, right_key=right_key)
        if args.quick:
            s = replace(s, steps=3, eval_every=3, eval_episodes=8, groups_per_step=2)
            args.seeds, args.horizons = 1, "4"
        results = execute(out, plan(args, s, out), s, args.jobs, previous)
        print(f"loadavg after {os.getloadavg()}", flush=True)
    if args.tune:
        print("\n".join(tune_lines(results)))
        return 0
    lines, summary = summarise(results)
    if not summary:
        print("ratio: no results")
        return 0
    figure = out / "credit_assignment.png"
    plot(results, summary, figure)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print("\n" + "\n".join(lines))
    print(f"curves: {figure}; raw per-run curves: {results_path}")
    print("\n".join(ratio_lines(summary)))
    return 0


def execute(out: Path, todo: list[tuple[tuple, list[str]]], s: Settings, jobs: int,
            previous: dict) -> list[dict]:
    """Run every planned run not already in ``previous`` with the same arguments."""
    results_path = out / "results.json"
    start = time.perf_counter()
    done = {tuple(r["key"]): r for r in previous.get("runs", [])}
    results = list(previous.get("runs", []))
    fresh = [(k, a) for k, a in todo if done.get(k, {}).get("args") != a]
    print(f"{len(todo) - len(fresh)} runs reused, {len(fresh)} to run", flush=True)
    ctx = get_context("spawn")  # fresh interpreters: no torch thread pools across a fork
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        pending = {pool.submit(run_one, key, a, s, a[a.index("--run.out_dir") + 1])
                   for key, a in fresh}
        finished = 0
        while pending:
            ready, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in ready:
                r = future.result()
                finished += 1
                results = [x for x in results if x["key"] != r["key"]] + [r]
                results_path.write_text(json.dumps({"runs": results}, indent=1) + "\n")
                b, a = r["before"], r["after"]
                print(f"[{finished}/{len(fresh)}] h{r['horizon']} {r['method']:<9}{r['tag']} "
                      f"seed {r['seed']}: success {b['success_rate']:.0%} -> "
                      f"{a['success_rate']:.0%}, cpu {r['cpu_s']:.0f} s; elapsed "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
    print(f"total wall time {time.perf_counter() - start:.0f} s", flush=True)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
