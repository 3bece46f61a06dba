"""A toy preference set (chosen replies of a's and b's, rejected ones of x's and y's) and
reward models for tests: trained on it by ``turnrl rm``, or a fresh score head."""

from __future__ import annotations

import json
import random
from pathlib import Path

from turnrl.config import load_config

TINY_RM = ["--model.name", "tiny", "--optim.lr", "3e-3", "--reward.eval_fraction", "0.25",
           "--run.progress", "false", "--run.checkpoint_every", "6"]


def write_pairs(path: Path, count: int = 40, seed: int = 0) -> Path:
    """``count`` pairs, one a line, in the prompt/chosen/rejected format."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(count):
            n = rng.randint(3, 8)
            chosen = "".join(rng.choice("ab") for _ in range(n))
            rejected = "".join(rng.choice("xy") for _ in range(n))
            f.write(json.dumps({"prompt": f"Task {i}: write a word.", "chosen": chosen,
                                "rejected": rejected}) + "\n")
    return path


def rm_config(data: Path, out: Path, steps: int = 12, *extra: str):
    return load_config(None, [*TINY_RM, "--reward.data", str(data), "--run.out_dir", str(out),
                              "--run.steps", str(steps), *extra])
