"""Reward over-optimisation (issue 54, 6b): RL against a learnt reward model alone, with the
task's true success and the reward model's score logged step by step.

Task. ``digit-first``: one turn, one prompt, success (reward 1) when the reply starts with a
digit; the tiny random model (154k parameters) rarely does.

Reward model. ``turnrl rm`` on preference pairs of that task from the tiny base: chosen
replies start with a digit, rejected ones hold no digit at all. The pairs cannot tell "starts
with a digit" from "has a digit somewhere", so the proxy may reward replies the task fails:
the gap between its score and true success is the figure (Gao et al. 2023,
arXiv:2210.10760, measure the same gap with a gold reward model; here the gold is the
checker).

Runs, same seeds, lr, steps:
- ``rm``: ``--reward.model RM --reward.env_weight 0 --reward.normalise zscore`` (the proxy
  alone);
- ``env``: the env's reward alone, the proxy still loaded with weight 0 so its score is
  logged for comparison.

Printed: the reward model's held-out pair accuracy; per step of each run the mean proxy
score of the step's episodes and their true success; held-out success before/after (Wilson
interval, pooled over seeds); the machine line; last line
``ratio: rm / env held-out success = X``.

Usage::

    python benchmarks/learning/overoptimisation.py --seeds 2 --steps 20 --out /tmp/overopt
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import figure, load_average, machine, ratio_line  # noqa: E402

from turnrl.config import load_config  # noqa: E402
from turnrl.envs import StepResult, register_env  # noqa: E402
from turnrl.metrics import read_metrics  # noqa: E402
from turnrl.sft.reward_model import train_reward_model  # noqa: E402
from turnrl.stats import wilson_interval  # noqa: E402
from turnrl.trainer import train  # noqa: E402

PROMPT = "Say a digit."
LETTERS = "abcdefghijklmnopqrstuvwxyz "


@register_env("digit-first")
class DigitFirst:
    """Success (reward 1) when the reply starts with a digit (one turn)."""

    async def reset(self, seed: int) -> str:
        return PROMPT

    async def step(self, action: str) -> StepResult:
        ok = action[:1].isdigit()
        return StepResult("", float(ok), True, {"success": ok})


def write_pairs(path: Path, count: int, seed: int) -> Path:
    """Chosen: a digit then letters; rejected: letters only (no digit anywhere)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            n = rng.randint(1, 3)
            chosen = rng.choice("0123456789") + "".join(rng.choice(LETTERS) for _ in range(n))
            rejected = "".join(rng.choice(LETTERS) for _ in range(n + 1))
            f.write(json.dumps({"prompt": PROMPT, "chosen": chosen, "rejected": rejected}) + "\n")
    return path


def reward_model(out: Path, pairs: int, steps: int) -> float:
    """Train the proxy into ``out``; its held-out pair accuracy."""
    data = write_pairs(out.parent / "pairs.jsonl", pairs, seed=0)
    cfg = load_config(None, ["--model.name", "tiny", "--reward.data", str(data),
                             "--run.out_dir", str(out), "--run.steps", str(steps),
                             "--optim.lr", "3e-3", "--run.progress", "false"])
    with contextlib.redirect_stdout(io.StringIO()):
        return train_reward_model(cfg).after["accuracy"]


def rl_run(out: Path, rm: Path, extra: list[str], seed: int, steps: int, episodes: int):
    """(per-step (proxy score, true success), held-out successes, episodes) of one run."""
    cfg = load_config(None, ["--model.name", "tiny", "--env.name", "digit-first",
                             "--rollout.max_new_tokens", "3", "--optim.lr", "2e-2",
                             "--optim.micro_batch_size", "32", "--run.steps", str(steps),
                             "--eval.episodes", str(episodes), "--run.progress", "false",
                             "--run.seed", str(seed), "--run.out_dir", str(out),
                             "--reward.model", str(rm), *extra])
    with contextlib.redirect_stdout(io.StringIO()):
        result = train(cfg)
    curve = [(r["reward/model_mean"], r["success/rate"])
             for r in read_metrics(out / "metrics.jsonl")]
    return curve, result.after.successes, result.after.episodes


RUNS = {"rm": ["--reward.env_weight", "0", "--reward.normalise", "zscore"],
        "env": ["--reward.model_weight", "0"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--rm-steps", type=int, default=30)
    parser.add_argument("--episodes", type=int, default=64, help="held-out episodes a run")
    parser.add_argument("--out", default="runs/overoptimisation")
    args = parser.parse_args(argv)
    load, out = load_average(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    accuracy = reward_model(out / "rm", args.pairs, args.rm_steps)
    print(f"reward model: held-out pair accuracy {accuracy:.2f} ({args.pairs} pairs)")
    rates = {}
    for name, extra in RUNS.items():
        runs = [rl_run(out / f"{name}-{seed}", out / "rm", extra, seed, args.steps,
                       args.episodes) for seed in range(args.seeds)]
        print(f"\n{name}: step, proxy score (mean over seeds), true success (mean over seeds)")
        for step in range(args.steps):
            score = sum(c[step][0] for c, _, _ in runs) / len(runs)
            success = sum(c[step][1] for c, _, _ in runs) / len(runs)
            print(f"  {step:>3} {score:>8.3f} {success:>6.2f}")
        wins, total = sum(w for _, w, _ in runs), sum(n for _, _, n in runs)
        low, high = wilson_interval(wins, total)
        rates[name] = wins / total
        print(f"{name}: held-out success after {rates[name]:.2f} [{low:.2f}, {high:.2f}] "
              f"({wins}/{total}); per seed " + " ".join(figure(w / n) for _, w, n in runs),
              flush=True)
    print(machine(load))
    ratio = rates["rm"] / rates["env"] if rates["env"] else float("inf")
    print(ratio_line("rm / env held-out success", ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
