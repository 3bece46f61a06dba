"""A model one learner process cannot hold and two FSDP ranks can (issue 52): full fine-tuning
under a per-process memory limit that world size 1 exceeds and world size 2 ``fsdp`` fits.

The limit is derived on this machine, at run time, never tuned here:
1. ``turnrl train`` runs 2 steps at ``--learner.world_size 1`` and at ``2`` (fsdp), unlimited;
   every learner process's peak virtual size (VmPeak: what RLIMIT_AS bounds) and peak resident
   size (VmHWM) are polled from /proc, rank by rank (rank 0 plays and samples too).
2. RLIMIT_AS is set halfway between world size 1's peak and the largest rank's at world size
   2 (on rank 0 before it starts; the ranks it starts inherit it).
3. Both run again under it: world size 1 must fail (its last line is printed), world size 2
   must train its steps.

Per rank the bytes of parameters + gradients + AdamW moments it holds are computed from the
model's shapes (FSDP2 shards every tensor along dim 0 as ``torch.chunk`` does; measured equal in
tests/trainer/test_ranks.py), plus rank 0's sampler: under fsdp rank 0 samples from its own
whole copy of the weights (trainer/run.py ``own_sampler``), so it holds P + 4P/W against one
process's 4P (P: the weights' bytes), 3/4 at W = 2.

Every run gets ``ENV``: with glibc's defaults the address space is not the memory in use
(a 64 MB arena reserved per thread that mallocs, and freed tensors kept in the heap), and
rank 0 at world size 2 has more threads (gloo's) than one process. The job is the default
job's with the smallest generation settings (``SMALL``): at the default settings activations
and the sampler's caches, not the weights, dominate the peak (docs/learner.md).

Also printed: ``time/publish_s`` (the sampler getting new weights: at world size 2 every
tensor gathered from its shards, ``learner/world.py gathered``) beside world size 1's, and
one process copying its whole state dict into a sampler copy (the same bytes, no gather).

Usage: ``python benchmarks/speed/learner_memory.py [--model smollm2-135m-instruct]
[--steps 2] [--quick] [--sampler-dtype bfloat16]`` (``--quick``: a small Llama built in code, for
tests; ``--sampler-dtype bfloat16``: every run samples from a bf16 copy of the weights).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

SMALL = ["--rollout.group_size", "2", "--rollout.groups_per_step", "1",
         "--rollout.max_turns", "1", "--rollout.max_new_tokens", "8",
         "--optim.micro_batch_size", "1", "--run.collapse_every", "0"]
"""The smallest generation settings: one group of 2 single-turn episodes a step, one row a
micro-batch (each rank scores one of the two), no collapse monitor (forward passes on 8
prompts: activations, not weights)."""
QUICK = ["--env.name", "arithmetic"]
"""``--quick``: a task whose prompt is a few dozen characters (the quick model's tokenizer
spends a token per character)."""
ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
       "TOKENIZERS_PARALLELISM": "false"}
"""glibc: one malloc arena, and every block of 64 KiB or more mapped on its own and unmapped
when freed (glibc's default threshold grows to 32 MB after the first big block is freed, and
tensors below it then come from a heap that keeps freed space), so that address space
tracks live tensors."""
MB = 2**20


@dataclass
class Run:
    """One ``turnrl train``: its exit code, last stderr line, steps logged, per-rank peaks."""

    code: int
    last: str
    steps: int
    vm_peak: dict[int, int] = field(default_factory=dict)  # rank -> bytes
    rss_peak: dict[int, int] = field(default_factory=dict)  # rank -> bytes
    publish_s: float | None = None
    rows: list[dict] = field(default_factory=list)  # metrics.jsonl, a dict a step


def process_peaks(pid: int, root: int) -> tuple[int | None, int, int, list[int]]:
    """(learner rank or None, VmPeak bytes, VmHWM bytes, children) of a process now."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        children = [int(c) for c in
                    Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None, 0, 0, []
    fields = {k: v.split() for k, _, v in (line.partition(":") for line in status.splitlines())}
    vm, rss = (int(fields.get(k, ["0"])[0]) * 1024 for k in ("VmPeak", "VmHWM"))
    rank = 0 if pid == root else None
    if b"turnrl.trainer.ranks" in argv:  # a child rank (its environ is read after exec)
        rank = next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), None)
    return rank, vm, rss, children


def watch(root: int, run: Run, done: threading.Event) -> None:
    """Keep each rank's largest VmPeak and VmHWM seen until ``done`` (both only grow)."""
    while not done.wait(0.1):
        todo = [root]
        while todo:
            rank, vm, rss, children = process_peaks(todo.pop(), root)
            todo += children
            if rank is not None:
                run.vm_peak[rank] = max(run.vm_peak.get(rank, 0), vm)
                run.rss_peak[rank] = max(run.rss_peak.get(rank, 0), rss)


def train(model: str, ranks: int, out: Path, steps: int, limit: int | None = None,
          extra: tuple[str, ...] = (), timeout_s: float = 3600, strategy: str = "fsdp",
          settings: tuple[str, ...] = tuple(SMALL), malloc: dict | None = None) -> Run:
    """``turnrl train`` for ``steps`` steps at world size ``ranks`` with ``settings`` (the
    smallest generation ones unless given; benchmarks/speed/learner_ranks.py passes none),
    every process under RLIMIT_AS ``limit`` bytes if given, with ``malloc`` (``ENV`` unless
    given) in its environment."""
    argv = [sys.executable, "-m", "turnrl", "train", "--model.name", model, *settings, *extra,
            "--run.steps", str(steps), "--eval.episodes", "0", "--run.progress", "false",
            "--run.checkpoint_every", "0", "--run.out_dir", str(out),
            "--learner.world_size", str(ranks), "--learner.strategy", strategy,
            "--run.threads", str(max(1, (os.cpu_count() or 1) // ranks))]

    def cap() -> None:  # in the child, before exec: rank 0, and the ranks it starts, inherit it
        if limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(ENV if malloc is None else malloc)}, preexec_fn=cap, start_new_session=True)
    run, done = Run(0, "", 0), threading.Event()
    watcher = threading.Thread(target=watch, args=(proc.pid, run, done), daemon=True)
    watcher.start()
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the session this call started: rank 0 and its ranks
        _, err = proc.communicate()
        err += f"\ntimed out after {timeout_s:.0f} s"
    done.set()
    watcher.join()
    run.code = proc.returncode
    run.last = (err.strip().splitlines() or ["(no stderr)"])[-1][:300]
    metrics = out / "metrics.jsonl"
    run.rows = rows = [json.loads(line) for line in metrics.read_text().splitlines()] \
        if metrics.is_file() else []
    run.steps = len(rows)
    publish = [r["time/publish_s"] for r in rows if "time/publish_s" in r]
    run.publish_s = statistics.median(publish) if publish else None
    return run


def limit_between(one: int, ranks: list[int]) -> int | None:
    """RLIMIT_AS halfway between one process's peak and the largest rank's; None where the
    ranks' largest is not below one process's (the limit cannot separate them)."""
    largest = max(ranks)
    return (one + largest) // 2 if largest < one else None


def shard_rows(rows: int, size: int, rank: int) -> int:
    """Rows of a dim-0 length ``rows`` that rank ``rank`` of ``size`` holds (``torch.chunk``:
    chunks of ceil(rows / size), the last ones shorter or empty), as FSDP2 shards."""
    chunk = -(-rows // size)
    return max(0, min(chunk, rows - rank * chunk))


def held_bytes(shapes: list[tuple[int, ...]], element: int, size: int,
               copy_element: int | None = None) -> list[int]:
    """Per rank, bytes of weights + gradients + AdamW's two moments it holds at world size
    ``size`` under fsdp, rank 0's whole sampler copy included: at ``copy_element`` bytes an
    element where given (a copy in another dtype, held at every size), else in the weights'
    own dtype at size > 1 (at size 1 the sampler samples from the learner's own tensors)."""
    def share(rank: int) -> int:
        return sum(shard_rows(s[0], size, rank) * math.prod(s[1:]) for s in shapes) * element * 4

    elements = sum(math.prod(s) for s in shapes)
    if copy_element is None:  # a copy in the weights' dtype, only where they are sharded
        copy_element = element if size > 1 else 0
    copy = elements * copy_element
    return [share(r) + (copy if r == 0 else 0) for r in range(size)]


def model_shapes(model: str) -> tuple[list[tuple[int, ...]], int]:
    """(shape of each distinct parameter, bytes per element) of ``model``, built on the meta
    device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from turnrl.models import model_directory

    config = AutoConfig.from_pretrained(model_directory(model))
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    params = {id(p): p for p in built.parameters()}.values()  # tied weights once
    return [tuple(p.shape) for p in params], 4


def quick_model(where: Path, hidden: int = 768, layers: int = 8) -> str:
    """A Llama of ``layers`` x ``hidden`` (about 75M weights: 300 MB, against rank 0's extra
    threads at world size 2, tens of MB) with the tiny model's character tokenizer, saved as a
    Hugging Face directory; its path."""
    from turnrl.models import tiny_model

    model, tokenizer = tiny_model(hidden_size=hidden, num_layers=layers, num_heads=12)
    model.save_pretrained(where)
    tokenizer.save_pretrained(where)
    return str(where)


def state_copy_seconds(model: str, repeats: int = 3) -> float:
    """One process publishing to a sampler copy: its whole state dict copied tensor by tensor
    into a second copy (``published_pairs``, no gather); the median over ``repeats``."""
    import copy

    import torch

    from turnrl.learner.weights import published_pairs
    from turnrl.models import load_model

    learner, _ = load_model(model)
    sampler = copy.deepcopy(learner).requires_grad_(False)
    target = sampler.state_dict()
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            for name, tensor in published_pairs(learner):
                target[name].copy_(tensor)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def rank_line(name: str, run: Run, held: list[int], limit: int | None) -> str:
    """``name  rank r: VmPeak / VmHWM / held MB ...`` and how the run ended."""
    ranks = "; ".join(f"rank {r}: {run.vm_peak.get(r, 0) // MB} / {run.rss_peak.get(r, 0) // MB}"
                      f" / {held[r] // MB}" for r in range(len(held)))
    where = f"under {limit // MB} MB" if limit else "unlimited"
    ended = (f"trained {run.steps} steps" if run.code == 0
             else f"failed (exit {run.code}, {run.steps} steps): {run.last}")
    return f"{name:<22} {where:<16} {ranks}  -> {ended}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="a ~75M-weight Llama built in code instead of --model")
    parser.add_argument("--no-publish", action="store_true",
                        help="skip timing one process's state-dict copy")
    parser.add_argument("--sampler-dtype", choices=["auto", "bfloat16"], default="auto",
                        help="bfloat16: every run samples from a bf16 copy of the weights "
                             "(--rollout.sampler hf --rollout.sampler_dtype bfloat16)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="learner-memory-"))
    try:
        return measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # run directories (and the quick model)


def measure(args: argparse.Namespace, work: Path) -> int:
    """Measure, derive the limit, run under it, print; 0 where it separates the two."""
    load = harness.load_average()
    model = quick_model(work / "model") if args.quick else args.model
    shapes, element = model_shapes(model)
    bf16 = args.sampler_dtype == "bfloat16"
    held = {n: held_bytes(shapes, element, n, 2 if bf16 else None) for n in (1, 2)}
    print("per rank: VmPeak / VmHWM / weights+grads+AdamW held (rank 0: + its sampler copy "
          f"{'in bf16, at both sizes' if bf16 else 'at size 2'}), MB")
    extra = tuple(QUICK if args.quick else ())
    if bf16:
        extra += ("--rollout.sampler", "hf", "--rollout.sampler_dtype", "bfloat16")
    measured = {n: train(model, n, work / f"measure{n}", args.steps, extra=extra)
                for n in (1, 2)}
    for n, run in measured.items():
        print(rank_line(f"world_size {n} measure", run, held[n], None))
    if any(run.code or len(run.vm_peak) != n for n, run in measured.items()):
        print("a measuring run failed or lost a rank: no limit derived")
        return 1
    limit = limit_between(measured[1].vm_peak[0], list(measured[2].vm_peak.values()))
    if limit is None:
        print("RLIMIT_AS cannot separate them: the largest rank's VmPeak is not below one "
              "process's")
        return 1
    limited = {n: train(model, n, work / f"limited{n}", args.steps, limit, extra)
               for n in (1, 2)}
    for n, run in limited.items():
        print(rank_line(f"world_size {n} fsdp" if n > 1 else "world_size 1", run, held[n],
                        limit))
    publish = {n: run.publish_s for n, run in measured.items()}
    copy_s = None if args.no_publish else state_copy_seconds(model)
    print(f"publish s (median time/publish_s): world_size 1 {harness.figure(publish[1], 3)}, "
          f"world_size 2 fsdp (gathered from shards) {harness.figure(publish[2], 3)}; one "
          f"process copying its state dict into a sampler copy {harness.figure(copy_s, 3)}")
    print(harness.machine(load, threads=os.cpu_count()))
    print(harness.ratio_line("world_size 2 fsdp largest rank / world_size 1 VmPeak",
                             max(measured[2].vm_peak.values()) / measured[1].vm_peak[0]))
    ok = limited[1].code != 0 and limited[2].code == 0 and limited[2].steps == args.steps
    print(f"separated: {'yes' if ok else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
