"""The policy update's cost with a LoRA adapter vs full fine-tuning, one process per setting.

One fixed batch shaped like a step of the default job (``--rows`` episodes of ``--prompt``
context tokens and ``--policy`` sampled tokens, the prompt shared in groups of 8), the policy
loaded as a run loads it (``--rank`` 0: full fine-tuning), the optimiser as a run builds it.
``--repeats`` updates (``trainer/step.py::policy_update``, the run's settings) after one
warm-up: wall and process CPU seconds, medians (CPU is the steadier one on a shared machine),
and the process's peak resident memory. Run it once per rank: peak memory is per process.

Usage: ``python benchmarks/speed/lora_update.py [--model smollm2-135m-instruct] [--rank 16]
[--rows 32] [--prompt 150] [--policy 36] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

import torch
from distill_cost import step_batch  # benchmarks/speed/, this folder

from turnrl.config import load_config
from turnrl.policy import load_policy
from turnrl.trainer.run import build_learner
from turnrl.trainer.step import policy_update

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=150)
    parser.add_argument("--policy", type=int, default=36)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cfg = load_config(None, ["--model.name", args.model, "--model.lora.r", str(args.rank),
                             "--eval.episodes", "0"])
    policy = load_policy(cfg)
    learner = build_learner(cfg, policy)
    batch = step_batch(len(policy.tokenizer), args.rows, args.prompt, args.policy)
    update = lambda: policy_update(learner.model, learner.optimizer, batch,  # noqa: E731
                                   learner.settings, learner.ref_model)
    load = harness.load_average()
    # The warm-up allocates the optimiser's moments; one setting a process (peak memory).
    rounds = harness.alternate({"update": update}, args.repeats)
    wall, cpu = rounds.medians()["update"], rounds.medians("cpu")["update"]
    trainable = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.model} r={args.rank}: {trainable:,} trainable parameters; update of "
          f"{args.rows} rows x ({args.prompt} + {args.policy}) tokens, median of "
          f"{args.repeats}: wall {wall:.2f} s, cpu {cpu:.2f} s; peak RSS {peak_mib:.0f} MiB")
    print(harness.machine(load))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
