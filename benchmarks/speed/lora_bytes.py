"""Bytes one policy version sends to each async rollout worker: LoRA ranks vs full weights.

What ``Fleet.publish`` puts in Ray's object store (``published_state``: the adapter alone
under ``model.lora``, every weight otherwise; a tied output layer once), in the model's
dtype, with the trainable parameter count beside it.

Usage: ``python benchmarks/speed/lora_bytes.py [--model tiny|smollm2-135m-instruct]
[--ranks 0 8 16 64]`` (rank 0: full fine-tuning).
"""

from __future__ import annotations

import argparse

import torch

from turnrl.config import load_config
from turnrl.distributed.worker_engines import without_tied_weights
from turnrl.lora import published_state, state_bytes
from turnrl.policy import load_policy


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
    full = None
    for rank in args.ranks:
        sent, trainable = version_bytes(args.model, rank)
        full = sent if rank == 0 else full
        share = f" ({sent / full:.1%} of full)" if full else ""
        print(f"{args.model} r={rank}: {sent:,} bytes per version ({sent / 2**20:.2f} MiB)"
              f"{share}, {trainable:,} trainable parameters")


if __name__ == "__main__":
    main()
