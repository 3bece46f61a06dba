"""Tree rollouts vs plain groups at equal sampled tokens, on a multi-turn task.

Task: ``key-corridor`` at horizon 4 (turnrl/envs/credit_tasks.py: a key picked at turn 1,
filler turns, the door at turn 4 opens with the right key; reward 1 or 0), the one
multi-turn builtin task the tiny random model (``--model.name tiny``) learns from scratch
on 2 cores; the right key is the one that model picks less often (measured at run time, as
credit_assignment.py does), 2 tokens a reply.

Arms (same lr, groups per step, evaluation; compared at equal sampled tokens):
- plain: ``rollout.group_size 8``: 8 independent episodes per seed.
- tree: ``rollout.group_size 4 --rollout.branch.turns 1 --rollout.branch.k 2``: 4 episodes
  per seed, each forked after turn 1 into 2 continuations: 8 leaves, turn 1 sampled 4 times
  instead of 8. The only turn that matters here is turn 1, before the fork: a task that
  favours the plain arm's 8 independent key choices, so a tie would already be the prefix
  sharing paying for itself, and a loss is what to expect.

Both use ``--algo.advantage tree_grpo``; without forks it is outcome GRPO on every turn
(tests/algorithms/test_tree.py), so the plain arm is GRPO. The tree arm samples fewer tokens
a step, so it runs 8/7 of the steps and evaluates every 8/7 as many steps (``TREE_STEPS``):
both arms are evaluated at the same sampled-token counts, and compared at the largest one
every run reached (each run's last evaluation within that budget). Sampled
tokens are counted once each (a sibling's copy of the shared prefix is not sampled):
``tree/sampled_tokens``. Throughput: sampled tokens / wall seconds of the collect stage, and
of the whole step.

Usage::

    python benchmarks/learning/tree_rollouts.py --out DIR            # 3 seeds x 2 arms
    python benchmarks/learning/tree_rollouts.py --quick --out DIR    # smoke test
    python benchmarks/learning/tree_rollouts.py --report-only --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ARMS = {
    "plain": ("--rollout.group_size", "8"),
    "tree": ("--rollout.group_size", "4", "--rollout.branch.turns", "1",
             "--rollout.branch.k", "2"),
}
TREE_STEPS = (8, 7)
"""The tree arm's steps (and steps between evaluations) over the plain arm's: key-corridor
episodes always play 4 turns of 2 tokens, so a plain step samples 4 x 8 x 8 = 256 tokens and
a tree step 4 x 4 x (2 + 2 x 6) = 224; 8 tree steps and 7 plain steps both sample 1792, so
the arms are evaluated at the same sampled-token counts."""
HORIZON = 4


def run_args(arm: str, seed: int, steps: int, every: int, a: argparse.Namespace,
             run_dir: str) -> list[str]:
    return [
        "--model.name", "tiny", "--model.device", "cpu",
        "--env.name", "key-corridor", "--env.options",
        json.dumps({"horizon": HORIZON, "keys": 2, "right_key": a.right_key}),
        "--rollout.groups_per_step", str(a.groups), "--rollout.max_turns", str(HORIZON),
        "--rollout.max_new_tokens", "2", *ARMS[arm],
        "--algo.advantage", "tree_grpo", "--optim.lr", str(a.lr),
        "--eval.episodes", str(a.eval_episodes), "--eval.every", str(every),
        "--eval.seed_offset", str(1_000_000 + 100_000 * seed),
        "--run.steps", str(steps), "--run.seed", str(seed), "--run.out_dir", run_dir,
        "--run.threads", "1", "--run.checkpoint_every", "0", "--run.keep_checkpoints", "1",
        "--run.sample_episodes", "0", "--run.progress", "false", "--run.tensorboard", "false",
    ]


def run_one(arm: str, seed: int, a: argparse.Namespace, out: Path) -> dict:
    """Train one run; its curve of (sampled tokens so far, held-out successes, episodes)."""
    from turnrl.config import load_config
    from turnrl.metrics import read_metrics
    from turnrl.trainer import train

    times, over = TREE_STEPS if arm == "tree" else (1, 1)
    steps, every = a.steps * times // over, a.eval_every * times // over
    run_dir = out / f"{arm}-seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, run_args(arm, seed, steps, every, a, str(run_dir)))
    with open(run_dir / "train.log", "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        result = train(cfg)
    records = read_metrics(run_dir / "metrics.jsonl")
    tokens, collect_s, step_s, curve = 0.0, 0.0, 0.0, [[0.0, result.before.successes,
                                                       result.before.episodes]]
    for r in records:
        tokens += r.get("tree/sampled_tokens", 0.0)
        collect_s += r.get("time/collect_s", 0.0)
        step_s += r.get("time/step_s", 0.0)
        if "eval/success" in r:
            curve.append([tokens, round(r["eval/success"] * a.eval_episodes), a.eval_episodes])
    if curve[-1][0] != tokens:
        curve.append([tokens, result.after.successes, result.after.episodes])
    return {"arm": arm, "seed": seed, "steps": steps, "tokens": tokens, "curve": curve,
            "collect_tokens_per_s": tokens / collect_s if collect_s else 0.0,
            "step_tokens_per_s": tokens / step_s if step_s else 0.0}


BUDGET_SLACK = 1.02
"""A reply that stops early samples a token less, so evaluations meant for the same count
land a few tokens apart: an evaluation within 2% of the budget counts as at it."""


def at_budget(run: dict, budget: float) -> tuple[int, int]:
    """(successes, episodes) of the run's last evaluation within ``budget`` sampled tokens."""
    within = [point for point in run["curve"] if point[0] <= budget * BUDGET_SLACK]
    return within[-1][1], within[-1][2]


def report(runs: list[dict]) -> str:
    from turnrl.stats import t_interval, wilson_interval

    budget = min(r["tokens"] for r in runs)
    lines = [f"held-out success at {budget:.0f} sampled tokens (the least any run reached; "
             "each run's last evaluation within it):",
             "arm    seeds  before            at budget         per-seed mean [95% t]     "
             "tokens/s collect  tokens/s step"]
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        before = [r["curve"][0][1:] for r in mine]
        after = [at_budget(r, budget) for r in mine]
        rates = [s / n for s, n in after]
        b_s, b_n = sum(s for s, _ in before), sum(n for _, n in before)
        a_s, a_n = sum(s for s, _ in after), sum(n for _, n in after)
        lo, hi = wilson_interval(a_s, a_n)
        mean, t_lo, t_hi = t_interval(rates)
        collect = sum(r["collect_tokens_per_s"] for r in mine) / len(mine)
        step = sum(r["step_tokens_per_s"] for r in mine) / len(mine)
        lines.append(f"{arm:6} {len(mine):5}  {b_s:3}/{b_n:<4} {b_s / b_n:6.1%}    "
                     f"{a_s:3}/{a_n:<4} {a_s / a_n:6.1%} [{lo:.1%}, {hi:.1%}]  "
                     f"{mean:6.1%} [{t_lo:.1%}, {t_hi:.1%}]  {collect:14.0f}  {step:13.0f}")
    return "\n".join([*lines, "", *by_evaluation(runs)])


def by_evaluation(runs: list[dict]) -> list[str]:
    """Pooled held-out success of each arm at each evaluation (the arms' n-th evaluations
    are at the same sampled-token counts, ``TREE_STEPS``)."""
    from turnrl.stats import wilson_interval

    points = min(len(r["curve"]) for r in runs)
    lines = ["eval  tokens (mean)  " + "  ".join(f"{arm:>26}" for arm in ARMS)]
    for k in range(points):
        cells = []
        for arm in ARMS:
            mine = [r["curve"][k] for r in runs if r["arm"] == arm]
            s, n = sum(p[1] for p in mine), sum(p[2] for p in mine)
            lo, hi = wilson_interval(s, n)
            cells.append(f"{s:3}/{n:<3} {s / n:6.1%} [{lo:.1%}, {hi:.1%}]")
        tokens = sum(r["curve"][k][0] for r in runs) / len(runs)
        lines.append(f"{k:4}  {tokens:13.0f}  " + "  ".join(f"{c:>26}" for c in cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=28,
                        help="the plain arm's steps (a multiple of 7)")
    parser.add_argument("--groups", type=int, default=4, help="rollout.groups_per_step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--eval-every", type=int, default=7, help="a multiple of 7")
    parser.add_argument("--eval-episodes", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="1 seed, 7 steps, 8 eval episodes")
    parser.add_argument("--report-only", action="store_true",
                        help="recompute the tables from --out/results.json")
    a = parser.parse_args()
    if a.report_only:
        print(report(json.loads((Path(a.out) / "results.json").read_text())))
        return
    if a.quick:
        a.seeds, a.steps, a.eval_every, a.eval_episodes = 1, 7, 7, 8
    if a.steps % TREE_STEPS[1] or a.eval_every % TREE_STEPS[1]:
        parser.error("--steps and --eval-every must be multiples of 7 (TREE_STEPS)")
    out = Path(a.out)
    sys.path.insert(0, str(Path(__file__).parent))
    from credit_assignment import measure_right_key

    a.right_key, rates = measure_right_key()
    print(f"right key {a.right_key} (the tiny model picks the keys at rates {rates})")
    runs, started = [], time.perf_counter()
    for seed in range(a.seeds):
        for arm in ARMS:
            runs.append(run_one(arm, seed, a, out))
            print(f"{arm} seed {seed}: {runs[-1]['tokens']:.0f} sampled tokens, curve "
                  f"{runs[-1]['curve']}", flush=True)
    (out / "results.json").write_text(json.dumps(runs, indent=1))
    print(report(runs))
    print(f"wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
