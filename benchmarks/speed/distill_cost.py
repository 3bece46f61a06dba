"""What the distillation teacher costs per step, relative to the policy update.

One fixed batch shaped like a step (``--rows`` episodes of ``--prompt`` context tokens and
``--policy`` sampled tokens, the prompt shared in groups of 8), the teacher the same
architecture as the student (a trained run of the same model). Alternating, ``--repeats``
times: the teacher scoring the batch (``trainer/distill.py::teacher_logprobs``, no grad) and
the update on it (``trainer/step.py::policy_update``, one epoch). Wall and process CPU
seconds, medians; the CPU ratio is the steadier one on a shared machine. The step's other
stages (collection above all) make the teacher's share of a whole step smaller still.

Usage: ``python benchmarks/speed/distill_cost.py [--model tiny|smollm2-135m-instruct] [--rows 32]
[--prompt 64] [--policy 32] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from turnrl.config import load_config
from turnrl.models import load_model
from turnrl.trainer.distill import teacher_logprobs
from turnrl.trainer.run import update_settings
from turnrl.trainer.step import make_optimizer, policy_update
from turnrl.types import Batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def step_batch(vocab: int, rows: int, prompt: int, policy: int) -> Batch:
    """Random tokens, a prompt shared by groups of 8 rows, then the policy's tokens."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, prompt + policy), generator=generator)
    for start in range(0, rows, 8):
        ids[start:start + 8, :prompt] = ids[start, :prompt]
    mask = torch.zeros(ids.shape)
    mask[:, prompt:] = 1
    old = -5 * mask  # an update's ratios are all that old log-probs change, not its cost
    return Batch(ids, torch.ones_like(ids), mask, old, torch.randn(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--policy", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    cfg = load_config(None, ["--model.name", args.model, "--optim.micro_batch_size", "8"])
    student, tokenizer = load_model(args.model)
    teacher, _ = load_model(args.model)
    teacher.eval().requires_grad_(False)
    settings = update_settings(cfg, student)
    optimizer = make_optimizer(student, cfg.optim)
    batch = step_batch(len(tokenizer), args.rows, args.prompt, args.policy)
    load = harness.load_average()
    rounds = harness.alternate(  # one warm-up of each, then alternating rounds
        {"teacher": lambda: teacher_logprobs(teacher, batch, settings),
         "update": lambda: policy_update(student, optimizer, batch, settings)}, args.repeats)
    walls, cpus = rounds.medians(), rounds.medians("cpu")
    print(f"{args.model}: {args.rows} rows x ({args.prompt} prompt + {args.policy} policy) tokens,"
          f" {torch.get_num_threads()} threads, medians of {args.repeats}")
    for name in walls:
        print(f"  {name:8s} wall {walls[name]:7.3f} s   cpu {cpus[name]:7.3f} s")
    for kind in ("wall", "cpu"):
        print(harness.interval_line(f"teacher / update {kind}", getattr(rounds, kind)["teacher"],
                                    getattr(rounds, kind)["update"]))
    print(harness.machine(load))
    print(harness.ratio_line("teacher / update cpu", cpus["teacher"] / cpus["update"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
