"""One update's share of the batch per rank, and the sums that make it the one-process update.

Every rank holds the whole step's batch (advantages computed once, over every group:
rank 0's are broadcast), takes its rows (``split_rows``: whole groups where there are enough,
balanced by tokens), and runs the one-process update on them with three differences, all in
``Share``:

- the loss is normalised by the GLOBAL token and sequence counts (``global_totals``), so each
  rank's loss is its part of the one-process loss and the summed gradients are that loss's
  gradient (DDP or FSDP averaging would divide by the world size: ``shard.py`` sums instead);
- under FSDP every forward and backward is a collective, so every rank runs as many
  micro-batch passes as the busiest one: the others repeat a pass with its loss times zero
  (``passes``);
- gradients (ddp: one all-reduce per optimiser step) and the metrics' sums are summed over
  the ranks; the gradient norm is then the global one, so clipping is too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from turnrl.learner.world import World
from turnrl.types import Batch

BUCKET_ELEMENTS = 1 << 24
"""Gradients all-reduced 16M values (64 MB in fp32) at a time: one message per bucket, not
per tensor, without a second copy of every gradient."""

MAXED = ("mismatch_max",)
"""Metric sums that are maxima over micro-batches (max over ranks too)."""


def global_totals(batch: Batch) -> dict[str, float]:
    """What the loss is normalised by: the whole batch's policy tokens and rows."""
    return {"tokens": float(batch.loss_mask[:, 1:].sum().clamp(min=1)),
            "seqs": float(len(batch))}


def split_rows(owners: list[int], tokens: list[int], size: int) -> list[list[int]]:
    """Rows per rank: units (rows with the same owner: a group sharing its prompt) assigned
    largest first to the rank with the fewest tokens so far (ties: the lower rank); with fewer
    units than ranks, rows alone. Deterministic: every rank computes the same split."""
    units: dict[int, list[int]] = {}
    for row, owner in enumerate(owners):
        units.setdefault(owner, []).append(row)
    groups = list(units.values()) if len(units) >= size else [[row] for row in range(len(owners))]
    groups.sort(key=lambda rows: (-sum(tokens[r] for r in rows), rows[0]))
    shares: list[list[int]] = [[] for _ in range(size)]
    load = [0] * size
    for rows in groups:
        rank = min(range(size), key=lambda r: (load[r], r))
        shares[rank].extend(rows)
        load[rank] += sum(tokens[r] for r in rows)
    return [sorted(rows) for rows in shares]


@dataclass
class Share:
    """This rank's part in one update (see the module docstring)."""

    world: World
    totals: dict[str, float]
    """``global_totals`` of the whole batch."""
    filler: Batch
    """One row of the whole batch: the pass a rank with no rows of its own repeats."""

    def passes(self, micro: list[Batch]) -> list[tuple[Batch, bool]]:
        """``(micro-batch, counts)`` pairs: this rank's own, then under FSDP as many repeats
        (``counts`` False: loss times zero, stats dropped) as the busiest rank has more
        (a rank with no rows of its own repeats ``filler``)."""
        own = [(mb, True) for mb in micro]
        if self.world.strategy != "fsdp":
            return own
        most = int(self.world.all_reduce(torch.tensor([len(micro)]), dist.ReduceOp.MAX))
        return own + [(micro[0] if micro else self.filler, False)] * (most - len(micro))

    def reduce_gradients(self, parameters: list[torch.Tensor]) -> None:
        """ddp: every trainable parameter's gradient summed over the ranks, in buckets
        (FSDP has already reduce-scattered them during backward)."""
        if self.world.strategy == "fsdp":
            return
        for p in parameters:
            if p.grad is None:  # a rank whose rows never reached it
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        for p in parameters:
            bucket.append(p.grad)
            if sum(g.numel() for g in bucket) >= BUCKET_ELEMENTS:
                self._sum(bucket)
                bucket = []
        if bucket:
            self._sum(bucket)

    def _sum(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.world.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def reduce_sums(self, sums: dict[str, float]) -> dict[str, float]:
        """The metrics' sums over every rank's micro-batches (maxima for ``MAXED``)."""
        keys = sorted(sums)
        added = torch.tensor([0.0 if k in MAXED else sums[k] for k in keys], dtype=torch.float64)
        maxed = torch.tensor([sums[k] if k in MAXED else 0.0 for k in keys], dtype=torch.float64)
        self.world.all_reduce(added)
        self.world.all_reduce(maxed, dist.ReduceOp.MAX)
        return {k: float(maxed[i] if k in MAXED else added[i]) for i, k in enumerate(keys)}
