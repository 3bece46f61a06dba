"""Options for tasks where plain training stalls, each against its baseline on a task made
for it (CPU, the tiny built-in model): KL-reference resets and success replay.

Task. ``first-digit``: one turn, one prompt, reward 1 when the reply starts with a digit. The
tiny random model (154k parameters) rarely does (a few percent of replies).

``--study reset`` (``algo.reference_reset_every``, ProRL: Liu et al. 2025, arXiv:2505.24864),
lr 2e-2, 20 steps: solving the task means moving far from the initial model, which a strong
KL penalty towards it resists.
- ``no_kl``: GRPO without a KL term (the ceiling here);
- ``kl``: KL coefficient ``--kl`` towards the initial model, never reset;
- ``kl_reset``: the same KL, the reference reset to the current policy every ``--every``
  steps (and AdamW's moments restarted).

``--study replay`` (``explore.success_replay_age``, ARPO/SPEAR), lr 5e-3, 10 steps: at a low
learning rate most groups of 8 still fail entirely early on, and a past success of the same
prompt gives them a signal.
- ``grpo``: plain GRPO;
- ``replay``: the same, with successes kept 8 steps.

Measured: held-out success after training (``--episodes`` held-out episodes a run, 64), pooled
over seeds with a Wilson interval, and the final step's KL. The settings (KL 1.0, lr 5e-3)
were picked once, to make the baseline stall, before the comparisons ran; nothing was tuned
on their results.

Usage::

    python benchmarks/learning/prolonged.py --study reset --seeds 3 --out /tmp/reset
    python benchmarks/learning/prolonged.py --study replay --seeds 3 --out /tmp/replay

The last line is ``ratio: kl_reset / kl held-out success = X`` (reset) or
``ratio: replay / grpo held-out success = X`` (replay).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import figure, load_average, machine, ratio_line  # noqa: E402

from turnrl.config import load_config  # noqa: E402
from turnrl.envs import StepResult, register_env  # noqa: E402
from turnrl.metrics import read_metrics  # noqa: E402
from turnrl.stats import wilson_interval  # noqa: E402
from turnrl.trainer import train  # noqa: E402


@register_env("first-digit")
class FirstDigit:
    """Reward 1 when the reply starts with a digit (one turn)."""

    async def reset(self, seed: int) -> str:
        return "Say a digit."

    async def step(self, action: str) -> StepResult:
        ok = action[:1].isdigit()
        return StepResult("", float(ok), True, {"success": ok})


STUDIES = {  # study: (lr, steps, the baseline, the option)
    "reset": ("2e-2", 20, "kl", "kl_reset"),
    "replay": ("5e-3", 10, "grpo", "replay"),
}


def methods(study: str, kl: float, every: int) -> dict[str, list[str]]:
    if study == "replay":
        return {"grpo": [], "replay": ["--explore.success_replay_age", "8"]}
    return {"no_kl": ["--algo.kl_coef", "0"],
            "kl": ["--algo.kl_coef", str(kl)],
            "kl_reset": ["--algo.kl_coef", str(kl), "--algo.reference_reset_every", str(every)]}


def run(out: Path, extra: list[str], seed: int, steps: int, episodes: int, lr: str
        ) -> tuple[int, int, float]:
    """(held-out successes, held-out episodes, last step's KL) of one training run."""
    cfg = load_config(None, ["--model.name", "tiny", "--env.name", "first-digit",
                             "--rollout.max_new_tokens", "3", "--optim.lr", lr,
                             "--optim.micro_batch_size", "32", "--run.steps", str(steps),
                             "--eval.episodes", str(episodes), "--run.progress", "false",
                             "--run.tensorboard", "false", "--run.seed", str(seed),
                             "--run.out_dir", str(out), *extra])
    with contextlib.redirect_stdout(io.StringIO()):
        result = train(cfg)
    kl = read_metrics(out / "metrics.jsonl")[-1].get("kl", 0.0)
    return result.after.successes, result.after.episodes, kl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", choices=sorted(STUDIES), default="reset")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="training steps (default: the study's)")
    parser.add_argument("--kl", type=float, default=1.0)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=64, help="held-out episodes a run")
    parser.add_argument("--out", default="runs/prolonged")
    args = parser.parse_args(argv)
    lr, steps, baseline, option = STUDIES[args.study]
    load = load_average()
    rates: dict[str, float] = {}
    print(f"{'method':<10} {'success':>8} {'95% Wilson':>14} {'last KL':>8}  per seed")
    for name, extra in methods(args.study, args.kl, args.every).items():
        runs = [run(Path(args.out) / f"{name}-{seed}", extra, seed, args.steps or steps,
                    args.episodes, lr) for seed in range(args.seeds)]
        wins = sum(won for won, _, _ in runs)
        total = sum(n for _, n, _ in runs)
        low, high = wilson_interval(wins, total)
        rates[name] = wins / total
        per_seed = " ".join(figure(won / n) for won, n, _ in runs)
        print(f"{name:<10} {rates[name]:>8.2f} {f'[{low:.2f}, {high:.2f}]':>14} "
              f"{figure(sum(k for _, _, k in runs) / len(runs), 3):>8}  {per_seed}", flush=True)
    print(machine(load))
    ratio = rates[option] / rates[baseline] if rates[baseline] else float("inf")
    print(ratio_line(f"{option} / {baseline} held-out success", ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
