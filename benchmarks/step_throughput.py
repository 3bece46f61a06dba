"""Whole RL steps, TurnRL vs TRL's GRPOTrainer on the same workload, measured side by side.

A thin wrapper over ``turnrl.bench`` (the same as ``turnrl bench``): single-turn arithmetic
prompts, G completions of exactly L tokens per prompt, float32, 2 threads; each system in its
own process, warm-up then alternating measured blocks; per-system medians (step, completion
tokens/s, generation, update, peak RSS), a TurnRL scaling table (group size, completion
length, turns) and, last, ``ratio: turnrl/trl completion tokens per second = X``.

Usage: ``python benchmarks/step_throughput.py [--groups 4 16] [--steps 4] [--no-scaling]
[--json OUT]``; ``--help`` lists every flag. Needs the bench extra: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import sys

from turnrl.bench import main

if __name__ == "__main__":
    sys.exit(main())
