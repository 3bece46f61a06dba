"""Generation guard: is this checkout's lock-step generation slower than a base checkout's?

The G=4 generation regression of issue 36 (a worker-thread hand-off added ~0.3 s to a 1.1 s
SmolLM2 collection) went unnoticed because nothing compared generation time across
versions, and a ratio against transformers' ``model.generate`` in the same process did not
separate the slow tree from the fast one. This guard compares two checkouts side by side:

- the base (``--base REF``; default: the commit recorded in ``generation_guard_base.txt``
  beside this script) is checked out in a temporary ``git worktree``, removed afterwards;
  ``--this REF`` does the same for the other side, which is otherwise this working tree as
  it is (uncommitted changes included);
- each round runs the same measurement once per tree, each in a fresh Python process whose
  ``PYTHONPATH`` is that tree (the process reports which ``turnrl`` it imported, and the
  guard checks it); rounds alternate which tree goes first (A B, B A, ...) so a load that
  drifts during a round weighs on both alike;
- the measurement: load the model once, then lock-step collections of one ``arithmetic``
  prompt x G completions of exactly ``--length`` tokens (``run_episodes``, as the sync
  trainer collects; no update in between, so every collection is the same work), one
  warm-up then ``--collections`` timed per G; only generation is timed, and a tree's figure
  in a round is its fastest collection (other processes on a busy machine only add time);
- per G the guard prints each round's seconds per tree and their ratio this/base,
  the medians over rounds and the median of the per-round ratios, with a verdict. A
  regression is declared only when a lower confidence bound of the per-round ratio's median
  (a sign-test bound: the k-th smallest ratio; with 5 rounds or fewer, the smallest) exceeds
  ``--threshold`` (default 1.10): a noisy round on a busy machine cannot fail it alone.

``--whole-step`` times the whole RL step instead (issue 57 item 4): collect + update, exactly
as ``benchmarks/speed/step_throughput.py`` times TurnRL's step (its ``TurnRLSession`` and
``turnrl_step``: the sync trainer's loop body, ``rl_step``, the weights published), one
warm-up then ``--collections`` timed steps per G in each fresh process, the fastest counting,
the same rounds and verdict; the base defaults to ``step_guard_base.txt``. That harness
needs the base to have ``rl_step``, ``build_learner``, ``publish`` and the ``rollout.sampler``
keys (2670619 and later). The per-stage seconds (collect, update) of each tree's fastest step
are printed beside the verdict, which judges the step alone.

``--slow-this F`` (for the guard's own tests) holds each of this tree's timed collections or
steps until it has taken F times as long: a real, measured slowdown of one side.

Exit status: 0 no regression (a median ratio over the threshold whose bound is not is
reported as inconclusive), 1 regression, 2 bad input or a failed measurement.

Usage: ``python benchmarks/guards/generation_guard.py [--whole-step] [--base REF] [--this REF]
[--model tiny] [--rounds 5] [--groups 4 16]``; ``make bench-guard ARGS='--base HEAD~3'``,
``make bench-guard ARGS=--whole-step``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

BASE_FILE = Path(__file__).resolve().with_name("generation_guard_base.txt")
STEP_BASE_FILE = BASE_FILE.with_name("step_guard_base.txt")
SPEED = BASE_FILE.parents[1] / "speed"  # step_throughput.py: the step the guard times
RESULT_PREFIX = "generation_guard-result: "
SIDES = ("base", "this")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
REGRESSION, PASS, INCONCLUSIVE = "REGRESSION", "pass", "inconclusive"


def ratio_prefix(what: str) -> str:
    """The ratio line up to its figures; ``what``: generation or step."""
    return f"ratio: this/base {what} seconds, median of rounds = "


RATIO_LINE = ratio_prefix("generation")


class GuardError(RuntimeError):
    """Bad input or a failed measurement; the message names the problem and the fix."""


# ---- the verdict (pure) ---------------------------------------------------------------------


def round_ratios(this: Sequence[float], base: Sequence[float]) -> list[float]:
    """Per-round ratios this/base of the two trees' figures, round by round."""
    if len(this) != len(base):
        raise ValueError(f"{len(this)} rounds of this tree but {len(base)} of the base")
    if any(not (b > 0 and math.isfinite(b)) for b in base):
        raise ValueError(f"base figures must be finite and positive, got {list(base)}")
    return [t / b for t, b in zip(this, base, strict=True)]


def binomial_tail(n: int, k: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2): how often k or fewer of n rounds fall below the
    true median."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def median_lower_bound(values: Sequence[float], confidence: float = 0.9) -> tuple[float, float]:
    """A distribution-free lower bound of the median of ``values`` and its confidence.

    The k-th smallest value is below the true median unless k-1 or fewer values are, which
    happens with probability ``binomial_tail(n, k-1)``: the largest k whose tail is at most
    ``1 - confidence`` is taken. With too few values for that (n <= 5 at 0.9) the smallest
    value stands in; its confidence, ``1 - 2**-n``, is returned beside it.
    """
    if not values:
        raise ValueError("no values to bound")
    ordered, n = sorted(values), len(values)
    k = 1
    while k < n and binomial_tail(n, k) <= 1 - confidence:
        k += 1
    return ordered[k - 1], 1 - binomial_tail(n, k - 1)


@dataclass(frozen=True)
class Verdict:
    """The guard's finding for one workload (a group size)."""

    workload: str
    ratios: tuple[float, ...]
    median: float
    lower_bound: float
    confidence: float
    threshold: float
    outcome: str
    """``REGRESSION`` (the bound exceeds the threshold), ``inconclusive`` (only the median
    does) or ``pass``."""


def judge(workload: str, ratios: Sequence[float], threshold: float,
          confidence: float = 0.9) -> Verdict:
    """The verdict on one workload's per-round ratios this/base."""
    if not ratios or not all(math.isfinite(r) and r > 0 for r in ratios):
        raise ValueError(f"{workload}: ratios must be finite and positive, got {list(ratios)}")
    median = statistics.median(ratios)
    bound, achieved = median_lower_bound(ratios, confidence)
    outcome = REGRESSION if bound > threshold else INCONCLUSIVE if median > threshold else PASS
    return Verdict(workload, tuple(ratios), median, bound, achieved, threshold, outcome)


def exit_code(verdicts: Sequence[Verdict]) -> int:
    """1 when any workload regressed, else 0."""
    return int(any(v.outcome == REGRESSION for v in verdicts))


def round_order(index: int) -> tuple[str, str]:
    """Which tree runs first in round ``index`` (0-based): base first, then alternating."""
    return SIDES if index % 2 == 0 else SIDES[::-1]


def recorded_base(text: str, source: Path = BASE_FILE) -> str:
    """The ref recorded in a base file (``generation_guard_base.txt``,
    ``step_guard_base.txt``): its first line that is neither blank nor a ``#`` comment, up to
    the first space."""
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return line.split()[0]
    raise GuardError(f"{source} names no commit; write one on a line of its own or pass "
                     "--base REF")


# ---- the measurement (run in a fresh process per tree and round) ------------------------------


def stretch(start: float, clock: str, factor: float) -> None:
    """Hold the call timed since ``start`` until it has taken ``factor`` times as long on
    ``clock`` (``--slow-this``): the wall clock waits, the CPU clock can only be spent."""
    timer = CLOCKS[clock]
    target = start + (timer() - start) * factor
    while (now := timer()) < target:
        if clock == "wall":
            time.sleep(target - now)


def measure(model_dir: str, groups: Sequence[int], collections: int, warmup: int, length: int,
            threads: int, seed: int, clock: str = "wall", slow: float = 1.0) -> dict:
    """Seconds of each timed lock-step collection per group size, with whatever ``turnrl``
    this process imports (the tree on ``PYTHONPATH``). Only long-lived public calls are used,
    so older trees run the same harness. ``clock``: ``wall`` seconds or ``cpu`` seconds of
    this process, all its threads (steadier beside other jobs, blind to idle waiting)."""
    import random
    from dataclasses import replace

    import numpy as np
    import torch

    import turnrl
    from turnrl.config import config_from_dict
    from turnrl.policy import load_policy, training_seeds
    from turnrl.rollout import run_episodes, run_sync

    timer = CLOCKS[clock]
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # as turnrl's trainer sets it (subnormals are slow)
    seconds: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    for group in groups:
        cfg = config_from_dict({
            "model": {"name": model_dir, "dtype": "float32", "device": "cpu"},
            "env": {"name": "arithmetic"},
            "rollout": {"group_size": group, "groups_per_step": 1, "max_new_tokens": length,
                        "max_turns": 1, "temperature": 1.0, "top_p": 1.0},
            "eval": {"episodes": 0},
            "run": {"seed": seed, "threads": threads},
        })
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        policy = load_policy(cfg)
        params = replace(policy.params, stop_token_ids=())  # every completion is `length` long
        times = []
        for index in range(warmup + collections):
            start = timer()
            episodes = run_sync(run_episodes(
                policy.make_env, training_seeds(cfg, index), policy.engine, policy.chat, params,
                env_name=cfg.env.name, max_turns=1, max_context=policy.max_context))
            stretch(start, clock, slow)
            times.append(timer() - start)
            learner_pass(policy.model, episodes)
        seconds[f"G={group}"] = times[warmup:]
        tokens[f"G={group}"] = sum(ep.num_policy_tokens for ep in episodes)
        del policy, episodes
    return {"turnrl": str(Path(turnrl.__file__).resolve()), "seconds": seconds,
            "tokens": tokens}


def measure_steps(model_dir: str, groups: Sequence[int], collections: int, warmup: int,
                  length: int, threads: int, seed: int, clock: str = "wall",
                  slow: float = 1.0) -> dict:
    """Seconds of each timed whole step (collect + update) per group size, with whatever
    ``turnrl`` this process imports: ``step_throughput``'s session and step (this checkout's
    harness), so the two trees run the same code around their own ``turnrl``. Also the
    stages (collect, update; wall seconds) of each timed step, for the report."""
    sys.path.insert(0, str(SPEED))
    from step_throughput import TurnRLSession, Workload, turnrl_config, turnrl_step

    import turnrl

    timer = CLOCKS[clock]
    seconds: dict[str, list[float]] = {}
    stages: dict[str, dict[str, list[float]]] = {}
    tokens: dict[str, int] = {}
    for group in groups:
        workload = Workload(model_dir, group_size=group, completion_length=length,
                            threads=threads, seed=seed)
        session = TurnRLSession.build(turnrl_config(workload))
        times, records = [], []
        for _ in range(warmup + collections):
            start = timer()
            records.append(turnrl_step(session))
            stretch(start, clock, slow)
            times.append(timer() - start)
        name = f"G={group}"
        seconds[name] = times[warmup:]
        stages[name] = {"collect": [r["gen_s"] for r in records[warmup:]],
                        "update": [r["update_s"] for r in records[warmup:]]}
        tokens[name] = records[-1]["completion_tokens"]
        del session
    return {"turnrl": str(Path(turnrl.__file__).resolve()), "seconds": seconds,
            "stages": stages, "tokens": tokens}


def learner_pass(model, episodes) -> None:
    """A forward and backward pass over the collected tokens on this (the main) thread, then
    the gradients dropped: the sync trainer updates between collections, and the 3100a78
    regression (generation handed to a worker thread) showed only then. Its torch threads
    were still spinning from the update when the generating thread's started, on 2 cores:
    collections back to back, with nothing between, timed the two trees alike."""
    import torch

    rows = [ep.token_ids for ep in episodes]
    width = min(len(row) for row in rows)
    ids = torch.tensor([row[:width] for row in rows])
    model.train()
    model(input_ids=ids).logits.float().log_softmax(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    model.eval()


def child_main(spec: str) -> int:
    """Entry of a measuring process: ``spec`` is ``measure``'s keyword arguments as JSON, and
    ``whole_step`` (true: ``measure_steps``)."""
    kwargs = json.loads(spec)
    result = (measure_steps if kwargs.pop("whole_step", False) else measure)(**kwargs)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# ---- checkouts ---------------------------------------------------------------------------------


def git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    if done.returncode:
        raise GuardError(f"git {' '.join(args)} failed in {root}: "
                         f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done.stdout.strip()


def repo_root() -> Path:
    """The checkout this script belongs to."""
    try:
        return Path(git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel"))
    except GuardError:
        raise GuardError(f"{Path(__file__).resolve().parent} is not inside a git checkout; "
                         "the guard checks out the base with git worktree") from None


def resolve_commit(root: Path, ref: str, option: str) -> str:
    """The full commit id ``ref`` names, or one line saying it names none."""
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "--quiet",
                           f"{ref}^{{commit}}"], capture_output=True, text=True)
    if done.returncode or not done.stdout.strip():
        raise GuardError(f"{option} '{ref}' is not a commit of {root}; pass a branch, tag or "
                         "commit (e.g. HEAD~1, origin/main)")
    return done.stdout.strip()


@contextlib.contextmanager
def temporary_worktree(root: Path, commit: str) -> Iterator[Path]:
    """A detached ``git worktree`` of ``commit``, removed (and pruned) on the way out."""
    parent = Path(tempfile.mkdtemp(prefix="turnrl-guard-"))
    tree = parent / commit[:12]
    git(root, "worktree", "add", "--detach", "--quiet", str(tree), commit)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)],
                       capture_output=True)
        subprocess.run(["git", "-C", str(root), "worktree", "prune"], capture_output=True)
        with contextlib.suppress(OSError):
            parent.rmdir()


def run_child(tree: Path, spec: dict, timeout_s: float) -> dict:
    """One measurement in a fresh process importing ``turnrl`` from ``tree``."""
    if not (tree / "turnrl" / "__init__.py").is_file():
        raise GuardError(f"{tree} has no turnrl/ package: not a TurnRL checkout (or a commit "
                         "from before turnrl/ existed); pass a newer --base")
    env = {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    with tempfile.TemporaryDirectory(prefix="turnrl-guard-run-") as cwd:
        try:
            done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise GuardError(f"the measurement of {tree} took over {timeout_s:.0f} s; raise "
                             "--child-timeout or use --model tiny") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise GuardError(f"the measurement of {tree} failed (exit {done.returncode}): {tail}")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    if not Path(result["turnrl"]).is_relative_to(tree.resolve()):
        raise GuardError(f"the measurement of {tree} imported turnrl from {result['turnrl']}; "
                         "unset anything that puts another turnrl before PYTHONPATH")
    return result


def describe(root: Path, commit: str | None) -> str:
    """A tree's commit and subject; the working tree also says whether it has changes."""
    if commit is not None:
        return git(root, "log", "-1", "--format=%h %s", commit)[:90]
    dirty = git(root, "status", "--porcelain", "--untracked-files=no")
    head = git(root, "log", "-1", "--format=%h %s", "HEAD")[:80]
    return f"working tree at {head}" + (" (with uncommitted changes)" if dirty else "")


# ---- rounds and report -------------------------------------------------------------------------


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan


def run_rounds(trees: dict[str, Path], specs: dict[str, dict], rounds: int, timeout_s: float,
               out=None) -> tuple[dict, dict]:
    """``rounds`` rounds of one fresh measurement per tree (``specs[side]``: the same but for
    ``slow``), alternating which goes first; each round's line is printed as it ends.
    Returns {side: {workload: figure per round}} and, where the measurement times stages
    (``--whole-step``), {side: {workload: {stage: seconds in the round's fastest call}}}."""
    figures: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    stages: dict[str, dict[str, dict[str, list[float]]]] = {side: {} for side in SIDES}
    tokens: dict[str, dict[str, int]] = {}
    for index in range(rounds):
        order, load = round_order(index), load_average()
        for side in order:
            result = run_child(trees[side], specs[side], timeout_s)
            tokens[side] = result["tokens"]
            for workload, times in result["seconds"].items():
                # The fastest call: a busy machine only ever adds time to one.
                fastest = times.index(min(times))
                figures[side].setdefault(workload, []).append(times[fastest])
                for stage, values in result.get("stages", {}).get(workload, {}).items():
                    stages[side].setdefault(workload, {}).setdefault(stage, []).append(
                        values[fastest])
        cells = [f"{w} base {figures['base'][w][-1]:.3f} this {figures['this'][w][-1]:.3f} "
                 f"(x{figures['this'][w][-1] / figures['base'][w][-1]:.3f})"
                 for w in figures["base"]]
        print(f"round {index + 1}/{rounds} ({' then '.join(order)}, load {load:.2f}, now "
              f"{load_average():.2f}): " + "  ".join(cells), file=out, flush=True)
    if tokens["base"] != tokens["this"]:  # different work: the ratio would mean nothing
        raise GuardError(f"the trees generated different token counts ({tokens}); they do not "
                         "run the same workload")
    return figures, stages


def print_stages(stages: dict[str, dict[str, dict[str, list[float]]]], out=None) -> None:
    """Per workload, each tree's stage seconds (medians of rounds) and their ratio: where a
    step's time went, not judged (the verdict is the whole step's)."""
    for workload, base in stages["base"].items():
        this = stages["this"][workload]
        cells = [f"{stage} base {statistics.median(base[stage]):.3f} this "
                 f"{statistics.median(this[stage]):.3f} "
                 f"(x{harness.ratio_of_medians(this[stage], base[stage]):.3f})" for stage in base]
        print(f"{workload} stages, wall s of each tree's fastest step, medians of rounds: "
              + "  ".join(cells), file=out)


def report(figures: dict[str, dict[str, list[float]]], threshold: float, confidence: float,
           out=None, what: str = "generation") -> list[Verdict]:
    """Medians, the median of per-round ratios and the verdict per workload, printed."""
    verdicts = []
    print(f"\n{'workload':<9}{'base s':>8}{'this s':>8}  {'ratio (median of rounds)':<25}"
          f"{'lower bound':<19}verdict", file=out)
    for workload, base in figures["base"].items():
        this = figures["this"][workload]
        verdict = judge(workload, round_ratios(this, base), threshold, confidence)
        verdicts.append(verdict)
        bound = f"{verdict.lower_bound:.3f} ({verdict.confidence:.0%})"
        print(f"{workload:<9}{statistics.median(base):>8.3f}{statistics.median(this):>8.3f}  "
              f"{verdict.median:<25.3f}{bound:<19}{verdict.outcome}", file=out)
    print(ratio_prefix(what) + ", ".join(f"{v.workload} {v.median:.3f}" for v in verdicts),
          file=out)
    regressed = [v.workload for v in verdicts if v.outcome == REGRESSION]
    unsure = [v.workload for v in verdicts if v.outcome == INCONCLUSIVE]
    if regressed:
        line = (f"verdict: REGRESSION in {', '.join(regressed)}: this tree's {what} is over "
                f"{threshold:.2f}x the base's in (nearly) every round")
    elif unsure:
        line = (f"verdict: inconclusive in {', '.join(unsure)}: the median ratio is over "
                f"{threshold:.2f} but not every round's; rerun with more --rounds on a quieter "
                "machine")
    else:
        line = f"verdict: pass (no workload over {threshold:.2f}x the base)"
    print(line, file=out)
    return verdicts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/guards/generation_guard.py",
        description="Fail when this checkout's lock-step generation (with --whole-step: its "
                    "whole RL step) is slower than a base checkout's, measured side by side "
                    "in alternating rounds.")
    parser.add_argument("--whole-step", action="store_true",
                        help="time the whole RL step (collect + update, as benchmarks/speed/"
                             "step_throughput.py times it) instead of generation")
    parser.add_argument("--base", default=None,
                        help="the reference tree: a branch, tag or commit (default: the commit "
                             "in benchmarks/guards/generation_guard_base.txt, with --whole-step "
                             "step_guard_base.txt)")
    parser.add_argument("--this", default=None,
                        help="the tree under test as a ref (default: this working tree as is)")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="smollm2-135m-instruct (default), tiny (a quick check), or a local "
                             "HF model directory")
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 16],
                        help="group sizes, one lock-step collection each (default 4 16)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds, each measuring both trees (default 5)")
    parser.add_argument("--collections", type=int, default=5,
                        help="timed collections (steps with --whole-step) per G in each "
                             "measurement, the fastest counts (default 5)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed collections per G before them (default 1)")
    parser.add_argument("--length", type=int, default=16,
                        help="tokens per completion, no early stop (default 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall seconds (default) or CPU seconds of the measuring process "
                             "(steadier on a busy machine; blind to time spent waiting)")
    parser.add_argument("--threshold", type=float, default=1.10,
                        help="fail above this ratio this/base (default 1.10)")
    parser.add_argument("--confidence", type=float, default=0.9,
                        help="confidence of the ratio's lower bound (default 0.9)")
    parser.add_argument("--child-timeout", type=float, default=900,
                        help="seconds one measurement may take (default 900)")
    parser.add_argument("--slow-this", type=float, default=1.0, metavar="F",
                        help="for the guard's own tests: hold each of this tree's timed calls "
                             "until it took F times as long, a slowdown it must catch (default 1)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("rounds", "collections", "length", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if min(args.groups) < 1:
        parser.error("--groups must be >= 1")
    if not args.slow_this >= 1:
        parser.error("--slow-this must be >= 1 (1: off)")
    if not args.threshold > 0:
        parser.error("--threshold must be > 0 (a ratio this/base, e.g. 1.10)")
    if not 0 < args.confidence < 1:
        parser.error("--confidence must be between 0 and 1 (e.g. 0.9)")
    return args


def headline(args: argparse.Namespace, groups: Sequence[int]) -> str:
    """The first line: what each fresh process times, how often, on which clock."""
    if args.whole_step:
        what = (f"generation_guard --whole-step: {args.model}, whole GRPO steps (collect + "
                f"update) of one arithmetic prompt x G in {list(groups)}")
        calls = "steps"
    else:
        what = (f"generation_guard: {args.model}, lock-step arithmetic collections of G in "
                f"{list(groups)}")
        calls = "collections"
    return (f"{what} completions x {args.length} tokens, {args.threads} thread(s); per tree and "
            f"round a fresh process: {args.warmup} warm-up + {args.collections} timed {calls} "
            f"per G (the fastest, {args.clock} clock); {args.rounds} rounds")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    sys.path.insert(0, str(SPEED))
    from step_throughput import BenchError, resolve_model_dir  # benchmarks/speed/

    spec = {"groups": list(dict.fromkeys(args.groups)), "collections": args.collections,
            "warmup": args.warmup, "length": args.length, "threads": args.threads,
            "seed": args.seed, "clock": args.clock, "whole_step": args.whole_step}
    base_file = STEP_BASE_FILE if args.whole_step else BASE_FILE
    load = harness.load_average()
    try:
        root = repo_root()
        base_ref = args.base or recorded_base(base_file.read_text(), base_file)
        base_commit = resolve_commit(root, base_ref, "--base")
        this_commit = None if args.this is None else resolve_commit(root, args.this, "--this")
        with contextlib.ExitStack() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="turnrl-guard-")))
            spec["model_dir"] = resolve_model_dir(args.model, tmp)
            trees = {"base": stack.enter_context(temporary_worktree(root, base_commit)),
                     "this": root if this_commit is None
                     else stack.enter_context(temporary_worktree(root, this_commit))}
            print(headline(args, spec["groups"]))
            print(f"base: {describe(root, base_commit)}")
            slowed = f" (slowed to {args.slow_this:g}x on purpose: --slow-this)"
            print(f"this: {describe(root, this_commit)}" + (slowed if args.slow_this != 1 else ""),
                  flush=True)
            specs = {"base": spec, "this": {**spec, "slow": args.slow_this}}
            figures, stages = run_rounds(trees, specs, args.rounds, args.child_timeout)
    except (GuardError, BenchError, OSError) as err:
        print(f"generation_guard: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the measuring process is killed, the worktrees removed
        print("generation_guard: interrupted; no verdict", file=sys.stderr)
        return 130
    print_stages(stages)
    print(harness.machine(load, threads=args.threads))
    what = "step" if args.whole_step else "generation"
    return exit_code(report(figures, args.threshold, args.confidence, what=what))


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # `kill` cleans up as Ctrl-C does: worktrees removed, child ended


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
