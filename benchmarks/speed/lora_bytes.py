"""Bytes one policy version sends to each async rollout worker: LoRA ranks vs full weights.

What ``Fleet.publish`` puts in Ray's object store (``published_state``: the adapter alone
under ``model.lora``, every weight otherwise; a tied output layer once), in the model's
dtype, with the trainable parameter count beside it. A count of bytes, not a timing: of the
shared harness (``benchmarks/harness.py``) it takes the machine line and the last line,
``ratio: r=R / full bytes per version = X`` (R the smallest rank above 0 asked for; ``n/a``
without both).

Usage: ``python benchmarks/speed/lora_bytes.py [--model tiny|smollm2-135m-instruct]
[--ranks 0 8 16 64]`` (rank 0: full fine-tuning).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from turnrl.config import load_config
from turnrl.distributed.worker_engines import without_tied_weights
from turnrl.lora import published_state, state_bytes
from turnrl.policy import load_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def version_bytes(model_name: str, rank: int) -> tuple[int, int]:
    """(bytes per published version, trainable parameters) of the policy at ``rank``."""
    torch.manual_seed(0)
    cfg = load_config(None, ["--model.name", model_name, "--model.lora.r", str(rank)])
    model = load_policy(cfg).model
    sent = state_bytes(without_tied_weights(published_state(model)))
    return sent, sum(p.numel() for p in model.parameters() if p.requires_grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 8, 16, 64])
    args = parser.parse_args()
    load = harness.load_average()
    full, sizes = None, {}
    for rank in args.ranks:
        sent, trainable = version_bytes(args.model, rank)
        sizes[rank] = sent
        full = sent if rank == 0 else full
        share = f" ({sent / full:.1%} of full)" if full else ""
        print(f"{args.model} r={rank}: {sent:,} bytes per version ({sent / 2**20:.2f} MiB)"
              f"{share}, {trainable:,} trainable parameters")
    print(harness.machine(load))
    low = min((rank for rank in sizes if rank > 0), default=None)
    if low is not None and 0 in sizes:
        print(harness.ratio_line(f"r={low} / full bytes per version", sizes[low] / sizes[0]))
    else:
        print(harness.ratio_line("r / full bytes per version", "n/a (needs rank 0 and one above)"))


if __name__ == "__main__":
    main()
