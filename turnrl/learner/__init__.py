"""The learner over several processes: ranks on torch.distributed (``learner`` section).

- ``world.py``: the ranks of this run (``World``), how rank 0 tells the others what to do,
  and which models are sharded over them;
- ``shard.py``: how a model is split over the ranks (FSDP2 per decoder layer, or whole
  copies for ddp);
- ``share.py``: one update's share of the batch per rank, and the sums that make the ranks'
  update the one-process update;
- ``checkpoints.py``: sharded checkpoints (torch.distributed.checkpoint) that load at any
  world size.

The loop that drives the ranks is ``trainer/ranks.py``'s; a world size of 1 never imports
torch.distributed's training pieces.
"""
