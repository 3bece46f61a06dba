"""``benchmarks/speed/learner_memory.py``: its arithmetic, and end to end on the quick model:
under the limit it derives from measured peaks, one process fails for want of memory and two
FSDP ranks train."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import learner_memory
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "speed" / "learner_memory.py"


def test_the_limit_lies_between_or_is_refused():
    assert learner_memory.limit_between(3000, [2000, 1500]) == 2500
    assert learner_memory.limit_between(3000, [3000, 1000]) is None  # not below: no limit
    assert learner_memory.limit_between(3000, [1000, 3100]) is None


def test_shards_are_torch_chunks_and_rank_0_adds_its_sampler_copy():
    for rows in (1, 5, 6, 7, 49152):
        for size in (1, 2, 3):
            chunks = [len(c) for c in torch.chunk(torch.empty(rows), size)]
            chunks += [0] * (size - len(chunks))  # torch.chunk drops empty tail chunks
            assert [learner_memory.shard_rows(rows, size, r) for r in range(size)] == chunks
    shapes = [(7, 3), (5,)]  # 26 elements, 4 bytes each
    assert learner_memory.held_bytes(shapes, 4, 1) == [26 * 4 * 4]
    # rank 0: rows 4 + 3 (12 + 3 elements) x 4 copies, plus the whole sampler copy
    assert learner_memory.held_bytes(shapes, 4, 2) == [15 * 16 + 26 * 4, 11 * 16]
    # a bf16 sampler copy: 2 bytes an element, on rank 0 at every size
    assert learner_memory.held_bytes(shapes, 4, 1, 2) == [26 * 16 + 26 * 2]
    assert learner_memory.held_bytes(shapes, 4, 2, 2) == [15 * 16 + 26 * 2, 11 * 16]


def test_one_process_fails_under_the_derived_limit_and_two_fsdp_ranks_train():
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--steps", "1",
                           "--no-publish"], capture_output=True, text=True, timeout=1800)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-2000:]
    limit = re.search(r"^world_size 1 +under (\d+) MB .*-> failed \(exit [-\d]+, \d+ steps\): "
                      r"(.*)$", out, re.M)
    assert limit, out
    assert re.search("memory", limit.group(2), re.I), out  # what failed was an allocation
    fits = re.search(rf"^world_size 2 fsdp +under {limit.group(1)} MB +rank 0: (\d+) / \d+ / "
                     r"\d+; rank 1: (\d+) / .*-> trained 1 steps$", out, re.M)
    assert fits and max(map(int, fits.groups())) <= int(limit.group(1)), out
    ratio = re.search(r"^ratio: world_size 2 fsdp largest rank / world_size 1 VmPeak = (\S+)$",
                      out, re.M)
    assert ratio and 0 < float(ratio.group(1)) < 1, out
    assert "separated: yes" in out
