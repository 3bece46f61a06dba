"""A verifiers taskset trained through ``--env.name verifiers``: its rubric's reward before/after.

One ``turnrl train`` run (GRPO, sync) on a verifiers 0.4 taskset, scored by the taskset's own
``@vf.reward``; the held-out evaluation before and after training plays the taskset's eval
rows, disjoint from the rows trained on. The default taskset is the test suite's
``tests/envs/external/vf_sums.py`` (What is a+b?), written in verifiers' own format.
``--held-out rows`` (default) holds out rows 30-44 of the train split (same distribution:
``eval_select``); ``--held-out split`` evaluates on the taskset's eval split
(``eval_taskset``), whose first addends (10..18) the train rows (1..9) never show.

It prints the machine, the run's command line, then mean reward and success (Wilson 95%
interval) before and after, and the ratio line. One run, one seed: a difference inside the
intervals is not a measured gain.

    python benchmarks/learning/verifiers_env.py                      # SmolLM2-135M, minutes
    python benchmarks/learning/verifiers_env.py --model tiny --steps 2 --episodes 8   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from turnrl.config import load_config
from turnrl.launch import train
from turnrl.metrics import read_metrics
from turnrl.stats import format_rate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import machine  # noqa: E402

TASKSET = "tests/envs/external/vf_sums.py"


HELD_OUT = {
    # disjoint rows of one distribution: rows 0-29 train, 30-44 held out (a+b, a in 1..9)
    "rows": {"taskset": {"num_tasks": 45}, "train_select": {"include": {"idx": "0:30"}},
             "eval_select": {"include": {"idx": "30:45"}}},
    # the taskset's own eval split: a in 10..18, a shift from the train rows' a in 1..9
    "split": {"eval_taskset": {"split": "eval"}},
}


def run_args(args: argparse.Namespace) -> list[str]:
    options = {"env_id": args.env_id, **HELD_OUT[args.held_out]}
    return ["--model.name", args.model, "--env.name", "verifiers",
            "--env.options", json.dumps(options),
            "--rollout.max_new_tokens", str(args.max_new_tokens),
            "--rollout.group_size", "8", "--rollout.groups_per_step", "4",
            "--run.steps", str(args.steps), "--optim.lr", str(args.lr), "--eval.episodes", str(args.episodes),
            "--eval.temperature", "0", "--run.seed", str(args.seed),
            "--run.progress", "false", "--run.tensorboard", "false",
            "--run.checkpoint_every", "0", "--run.out_dir", args.out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--env-id", default=TASKSET)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--episodes", type=int, default=15,
                        help="held-out eval episodes (greedy: one per held-out row)")
    parser.add_argument("--held-out", choices=sorted(HELD_OUT), default="rows")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=4e-5, help="optim.lr (4e-5: the default)")
    parser.add_argument("--out", default="runs/verifiers-env")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    argv = run_args(args)
    print(f"# command: turnrl train {shlex.join(argv)}", flush=True)
    started = time.perf_counter()
    train(load_config(None, argv))
    seconds = time.perf_counter() - started
    out = Path(args.out)
    before = json.loads((out / "eval_before.json").read_text())
    after = json.loads((out / "eval_after.json").read_text())
    print(machine(load_start))
    print(f"run: {args.steps} steps x 32 episodes in {seconds:.0f} s")
    rewards = [r["reward/mean"] for r in read_metrics(out / "metrics.jsonl")]
    print(f"training reward (train rows) by step: {' '.join(f'{r:.2f}' for r in rewards)}")
    for name, result in (("before", before), (f"after {args.steps} steps", after)):
        print(f"{name:>16}: mean reward {result['mean_reward']:.3f}, success "
              f"{format_rate(result['successes'], result['episodes'])} "
              f"({result['episodes']} held-out episodes)")
    gain = after["mean_reward"] / before["mean_reward"] if before["mean_reward"] else None
    print(f"ratio: held-out mean reward after / before = "
          f"{'n/a (before is 0)' if gain is None else f'{gain:.2f}'}")


if __name__ == "__main__":
    main()
