"""The simulated-user task learnt against the scripted user, and the same policy measured
against a model user: held-out success with Wilson 95% intervals.

``simulated-user`` (docs/simulated_users.md): a patient with a hidden diagnosis; the policy
asks about symptoms and answers ``answer: NAME``. GRPO trains the policy against the
scripted user (exact yes/no answers from the task's facts), then the base and trained
policies are evaluated on the held-out patients (the eval split: no training patient) against
the scripted user and against a model user (the base model itself plays the patient), so the
table shows what training bought and what an imprecise user costs.

    python benchmarks/learning/simulated_user.py                     # SmolLM2, CPU
    python benchmarks/learning/simulated_user.py --model tiny --steps 2 --episodes 8  # smoke
    python benchmarks/learning/simulated_user.py --warmup-steps 8 --warmup-demos 42
    python benchmarks/learning/simulated_user.py --warmup-steps 16 --guidance

Measured (docs/simulated_users.md#measured): the base SmolLM2-135M-Instruct solves 0 of the
held-out patients (GRPO alone has no signal); ``--warmup-steps 16 --warmup-demos 64
--guidance`` solved 9, 5 and 5 of 28 after the warm-up and 15, 7 and 10 after 12 RL steps
(seeds 0-2), against a model user (SmolLM2 playing the patient) 0-1 of 28. Seven held-out patients:
the by-patient line, not the per-episode interval, says how sure that is.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from turnrl.checkpoint import latest_checkpoint
from turnrl.config import load_config
from turnrl.launch import train
from turnrl.metrics import print_table
from turnrl.policy import load_policy
from turnrl.stats import sign_flip_test, t_interval
from turnrl.trainer.evaluation import held_out_eval

HEADERS = ["policy", "user", "success [95% CI]", "mean reward", "mean turns", "episodes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=12, help="RL steps")
    parser.add_argument("--episodes", type=int, default=28, help="held-out eval episodes")
    parser.add_argument("--out", default="runs/simulated-user")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup-steps", type=int, default=0, help="SFT steps before RL")
    parser.add_argument("--warmup-demos", type=int, default=42,
                        help="reference-player episodes the warm-up trains on")
    parser.add_argument("--guidance", action="store_true",
                        help="guided RL: the reference player's episode joins each all-failed "
                             "group (--explore.guidance demo)")
    parser.add_argument("--seed", type=int, default=0, help="run.seed (episodes, sampling)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    common = ["--env.name", "simulated-user", "--env.options.max_turns", "5",
              "--rollout.max_turns", "5", "--rollout.max_new_tokens", "12",
              "--rollout.group_size", "6", "--rollout.groups_per_step", "2",
              "--eval.episodes", str(args.episodes), "--eval.temperature", "1.0",
              "--run.progress", "false", "--run.tensorboard", "false",
              "--optim.lr", "2e-5", "--run.seed", str(args.seed)]
    started = time.perf_counter()
    warmup = (["--sft.steps", str(args.warmup_steps), "--sft.env_demos", str(args.warmup_demos)]
              if args.warmup_steps else [])
    if args.guidance:
        warmup += ["--explore.guidance", "demo"]
    cfg = load_config(None, ["--model.name", args.model, *common, *warmup, "--run.steps",
                             str(args.steps), "--run.checkpoint_every", str(args.steps),
                             "--run.out_dir", args.out])
    result = train(cfg)
    start = "after warm-up" if args.warmup_steps else "base"  # what RL started from
    rows = [[start, "scripted", *result.before.row("")[1:]],
            ["after RL", "scripted", *result.after.row("")[1:]]]
    user = ["--env.options.opponent", "model", "--env.opponent_model", args.model]
    trained = str(latest_checkpoint(result.run_dir))
    for label, name in (("base", args.model), ("after RL", trained)):
        model_cfg = load_config(None, ["--model.name", name, *common, *user])
        measured, _ = held_out_eval(model_cfg, load_policy(model_cfg))
        rows.append([label, f"model ({args.model})", *measured.row("")[1:]])
    print_table(f"simulated-user, held-out patients, {args.steps} RL steps against the "
                "scripted user", HEADERS, rows)
    before, after = (by_patient(Path(result.run_dir) / f"eval_{w}.jsonl") for w in ("before", "after"))
    print(f"by patient (scripted user; the {len(after)} held-out patients are the units, each "
          f"played {args.episodes // max(1, len(after))}+ times): {start} {patient_line(before)}; "
          f"after RL {patient_line(after)}; paired sign-flip p = "
          f"{sign_flip_test([after[k] - before[k] for k in after]):.3f}")
    print(f"wall time {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores; run dir {result.run_dir}")


def by_patient(episodes: Path) -> dict[str, float]:
    """Each held-out patient's (its right answer's) success rate in an ``eval_*.jsonl``."""
    wins: dict[str, list[bool]] = {}
    for line in episodes.read_text().splitlines():
        row = json.loads(line)
        patient = row["info"]["judge_reference"].rsplit("The right answer: ", 1)[-1]
        wins.setdefault(patient.rstrip("."), []).append(bool(row["success"]))
    return {patient: sum(w) / len(w) for patient, w in sorted(wins.items())}


def patient_line(rates: dict[str, float]) -> str:
    """``53.6% [18.9, 88.2] (t over 7 patients)``: episodes of one patient are not
    independent, so the interval is over patients, not episodes."""
    mean, lo, hi = t_interval(list(rates.values()))
    lo, hi = max(0.0, lo), min(1.0, hi)  # a rate: the t interval clipped to [0, 1]
    return f"{100 * mean:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] (t over {len(rates)} patients)"


if __name__ == "__main__":
    main()
