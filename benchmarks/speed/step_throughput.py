"""Whole RL steps through TurnRL and TRL's GRPOTrainer, side by side.

One workload for both systems: single-turn ``arithmetic`` prompts (seeded), ``P`` prompts per
step, ``G`` completions per prompt, each exactly ``L`` tokens long (no early stop in either
system, so completion tokens per second compare like for like), float32, temperature 1, the
same learning rate, no KL, the same reward (the arithmetic check), one optimiser step per
generated batch. A TurnRL step is the sync trainer's loop body (``turnrl_step``: collect ->
``rl_step``, the one RL step every TurnRL mode runs); a TRL step is one ``GRPOTrainer``
optimiser step, timed by a callback.

Each system runs in its own worker process (one per system and workload): the peak resident
memory of a process is then that system's alone, and neither model, allocator arena nor
thread pool of one system sits in the other's way. The parent alternates measured blocks
between the workers (ABAB, after each worker's warm-up) and only one worker computes at a
time; the idle one waits on a pipe. A TurnRL-only scaling table follows (group size,
completion length, turns of the multi-turn ``guess-number``); the last line is
``ratio: turnrl/trl completion tokens per second = X``, the minimum over the workloads, after
the harness's machine line (``benchmarks/harness.py``: the alternation order, the ratios of
medians and the report lines; ``training_job.py``: the job's TurnRL config keys).

Usage: ``python benchmarks/speed/step_throughput.py [--groups 4 16] [--steps 4] [--json OUT]``;
``--quick`` runs the tiny model for tests. Needs the bench extra (``pip install -e
'.[bench]'``, which ``make test`` installs) for the TRL side.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from training_job import config as job_config  # benchmarks/speed/, this folder
from training_job import job_keys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

SYSTEMS = ("turnrl", "turnrl-torch", "trl")
"""turnrl-torch: TurnRL with ``sampler.matmul torch`` (its sampler on torch's products), in the
same alternating blocks as ``turnrl`` (``--matmul`` picks turnrl's own)."""
TRL_MISSING = ("step_throughput: TRL is not installed; run `pip install -e '.[bench]'` "
               "(or pass --systems turnrl)")
RATIO = "turnrl/trl completion tokens per second"


class BenchError(RuntimeError):
    """A worker failed or the workload cannot run; the message says which and why."""


@dataclass(frozen=True)
class Workload:
    """One RL step's work, identical for every system that runs it."""

    model_dir: str
    """A Hugging Face model directory both systems load (the same weights and tokenizer)."""
    env: str = "arithmetic"
    env_options: tuple[tuple[str, Any], ...] = ()
    group_size: int = 4
    prompts: int = 1
    completion_length: int = 16
    turns: int = 1
    lr: float = 1e-6
    seed: int = 0
    threads: int = 2
    warmup: int = 1
    measured: int = 4
    """Measured steps the worker will be asked for in all (TRL needs ``max_steps`` upfront)."""
    engine: str = "hf"
    engine_dtype: str = "auto"
    """TurnRL's sampler (``rollout.sampler``/``engine_dtype``: ct2 int8, a bf16 copy)."""
    matmul: str = "auto"
    """TurnRL's sampler's matrix products on CPU (``sampler.matmul``: onednn, torch)."""
    compute_dtype: str = "float32"
    """TurnRL's update (``optim.compute_dtype``: bfloat16 = autocast, float32 weights)."""
    trl_bf16: bool = False
    """TRL's ``bf16`` (its autocast, float32 weights): the like-for-like partner of
    ``compute_dtype bfloat16``."""

    @property
    def completions(self) -> int:
        return self.group_size * self.prompts


# ---- memory ---------------------------------------------------------------------------------


def _status_kb(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


class PeakRSS:
    """Peak resident memory of this process, overall and since the last ``reset``.

    On Linux the kernel's high-water mark (VmHWM) is read and, where allowed, reset through
    ``/proc/self/clear_refs`` so a step's own peak can be read. Resetting also clears
    ``getrusage``'s ``ru_maxrss``, so the process peak is kept here across resets.
    Elsewhere ``ru_maxrss`` (never reset) stands in for both.
    """

    def __init__(self) -> None:
        self.process_peak_mb = 0.0
        self.resettable = _status_kb("VmHWM") is not None

    def _hwm_mb(self) -> float:
        kb = _status_kb("VmHWM")
        if kb is None:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            kb = peak / 1024 if sys.platform == "darwin" else peak  # bytes on macOS
        self.process_peak_mb = max(self.process_peak_mb, kb / 1024)
        return kb / 1024

    def current_mb(self) -> float:
        kb = _status_kb("VmRSS")
        if kb is not None:
            return kb / 1024
        import psutil

        return psutil.Process().memory_info().rss / 2**20

    def reset(self) -> float:
        """Start a new window; returns the resident memory at its start (MB)."""
        self._hwm_mb()
        if self.resettable:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self.resettable = False
        return self.current_mb()

    def window_peak_mb(self) -> float:
        """Peak since ``reset`` (since process start where the mark cannot be reset)."""
        return self._hwm_mb()

    def process_mb(self) -> float:
        self._hwm_mb()
        return self.process_peak_mb


# ---- TurnRL side ----------------------------------------------------------------------------


def turnrl_config(wl: Workload):
    """The TurnRL ``Config`` of a workload (defaults for everything it does not name)."""
    keys = job_keys(wl.model_dir, wl.env, group_size=wl.group_size, groups_per_step=wl.prompts,
                    max_new_tokens=wl.completion_length, seed=wl.seed,
                    env_options=dict(wl.env_options), max_turns=wl.turns, lr=wl.lr,
                    threads=wl.threads)
    keys.update({"model.dtype": "float32", "model.device": "cpu", "rollout.temperature": 1.0,
                 "rollout.top_p": 1.0, "rollout.sampler": wl.engine,
                 "rollout.sampler_dtype": wl.engine_dtype, "sampler.matmul": wl.matmul,
                 "algo.advantage": "grpo", "algo.kl_coef": 0.0, "algo.entropy_coef": 0.0,
                 "algo.epochs": 1, "optim.compute_dtype": wl.compute_dtype})
    return job_config(keys)


@dataclass
class TurnRLSession:
    """What the sync trainer holds between steps, built the way ``train`` builds it.

    The one departure: sampling never stops early (``stop_token_ids=()``), so every turn is
    exactly ``max_new_tokens`` long, as on the TRL side.
    """

    cfg: Any
    policy: Any
    learner: Any
    params: Any
    step: int = 0

    @classmethod
    def build(cls, cfg) -> TurnRLSession:
        import random

        import numpy as np
        import torch

        from turnrl.models import configure_torch
        from turnrl.policy import load_policy
        from turnrl.trainer.run import build_learner

        configure_torch(cfg.run.threads)
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        policy = load_policy(cfg)
        params = replace(policy.params, stop_token_ids=())
        return cls(cfg, policy, build_learner(cfg, policy), params)


def turnrl_step(session: TurnRLSession) -> dict[str, Any]:
    """One training step exactly as the sync trainer's loop runs it, timed by stage.

    Returns wall seconds (``step_s``, ``gen_s`` = collecting the episodes, ``update_s`` = the
    rest: ``rl_step``'s advantages, batch, update and metrics) and token counts.
    """
    import torch

    from turnrl.policy import publish, training_seeds
    from turnrl.rollout import run_episodes, run_sync
    from turnrl.trainer.rl_step import StageTimer, rl_step

    cfg, policy = session.cfg, session.policy
    timer = StageTimer()
    start = time.perf_counter()
    with timer("collect"):
        episodes = run_sync(run_episodes(
            policy.make_env, training_seeds(cfg, session.step), policy.engine, policy.chat,
            session.params, env_name=cfg.env.name, max_turns=cfg.rollout.max_turns,
            max_context=policy.max_context, env_timeout_s=cfg.rollout.env_timeout_s))
    summary, _ = rl_step(session.learner, episodes, timer)
    session.step += 1
    with timer("publish"):  # an engine with weights of its own reloads them (counted)
        publish(policy.engine, policy.model, session.step)
    step_s = time.perf_counter() - start
    turn_lengths = [t.end - t.start for ep in episodes for t in ep.turns]
    return {
        "step_s": step_s,
        "gen_s": timer.seconds["collect"],
        "update_s": step_s - timer.seconds["collect"],
        "stages_s": dict(timer.seconds),
        "completions": sum(len(ep.turns) for ep in episodes),
        "completion_tokens": sum(ep.num_policy_tokens for ep in episodes),
        "min_completion_len": min(turn_lengths, default=0),
        "max_completion_len": max(turn_lengths, default=0),
        "prompt_tokens": statistics.fmean(ep.turns[0].start if ep.turns else len(ep.token_ids)
                                          for ep in episodes),
        "turns": statistics.fmean(len(ep.turns) for ep in episodes),
        "reward": summary.mean_reward,
        "threads": torch.get_num_threads(),
    }


def _measured(step_fn, meter: PeakRSS) -> dict[str, Any]:
    base = meter.reset()
    record = step_fn()
    record["rss_base_mb"] = base
    record["rss_peak_mb"] = meter.window_peak_mb()
    return record


def _serve_turnrl(conn, meter: PeakRSS) -> None:
    session = None
    while True:
        cmd, arg = conn.recv()
        if cmd == "setup":
            session = None
            gc.collect()
            wl = Workload(**arg)
            session = TurnRLSession.build(turnrl_config(wl))
            loaded = meter.current_mb()
            warm = [turnrl_step(session) for _ in range(wl.warmup)]
            conn.send(("ok", {"warmup_s": [r["step_s"] for r in warm],
                              "rss_loaded_mb": loaded}))
        elif cmd == "run":
            conn.send(("ok", [_measured(partial(turnrl_step, session), meter)
                              for _ in range(arg)]))
        elif cmd == "stop":
            conn.send(("ok", {"peak_rss_mb": meter.process_mb()}))
            return
        else:
            raise BenchError(f"unknown command {cmd!r}")


# ---- TRL side -------------------------------------------------------------------------------


def trl_available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("trl", "datasets"))


def trl_prompts(wl: Workload, steps: int) -> list[dict[str, Any]]:
    """Dataset rows for ``steps`` steps: the prompts TurnRL plays at the same steps, in order.

    Conversational rows (``prompt`` = the messages TurnRL's ``ChatFormat.start`` renders:
    the env's system prompt if it has one, then the observation as the user message), so
    TRL applies the same chat template to the same messages; ``answer`` feeds the reward.
    """
    from turnrl.envs import make_env
    from turnrl.policy import training_seeds
    from turnrl.rollout import run_sync

    cfg = turnrl_config(wl)
    rows = []
    for step in range(steps):
        for seed, _ in training_seeds(cfg, step)[::wl.group_size]:
            env = make_env(wl.env, **dict(wl.env_options))
            observation = run_sync(env.reset(seed))
            system = getattr(env, "system_prompt", None)
            messages = [{"role": "system", "content": system}] if system else []
            rows.append({"prompt": messages + [{"role": "user", "content": observation}],
                         "answer": env.answer})
    return rows


def arithmetic_reward(completions, answer, **kwargs) -> list[float]:
    """The ``arithmetic`` env's check (last integer of the reply equals the sum), for TRL."""
    from turnrl.rewards import integer_match

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [integer_match(text, a, which="last") for text, a in zip(texts, answer, strict=True)]


def trl_batch_shape(wl: Workload, micro_batch_size: int) -> tuple[int, int]:
    """(per-device batch, gradient accumulation steps) for one optimiser step per generation.

    The micro-batch is TurnRL's (``optim.micro_batch_size`` rows, or the largest divisor of
    the step's completions up to it) so both systems run forward and backward on the same
    number of rows at a time.
    """
    size = max(d for d in range(1, min(micro_batch_size, wl.completions) + 1)
               if wl.completions % d == 0)
    return size, wl.completions // size


def trl_config(wl: Workload, output_dir: str):
    """GRPOConfig matching TurnRL's step; every departure from TRL's defaults is for parity."""
    from trl import GRPOConfig

    cfg = turnrl_config(wl)
    per_device, accumulation = trl_batch_shape(wl, cfg.optim.micro_batch_size)
    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        # TRL defaults to bf16; float32 unless asked (--trl-bf16, beside --compute-dtype)
        bf16=wl.trl_bf16, fp16=False,
        gradient_checkpointing=False,  # TRL's default recomputes activations; TurnRL does not
        seed=wl.seed,
        # One generation of G*P completions, then one optimiser step over it.
        num_generations=wl.group_size,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_iterations=1,
        max_steps=wl.warmup + wl.measured,
        shuffle_dataset=False,  # step s plays the prompts TurnRL plays at step s
        # Exactly L completion tokens: end-of-turn is masked until L tokens are out.
        max_completion_length=wl.completion_length,
        generation_kwargs={"min_new_tokens": wl.completion_length},
        mask_truncated_completions=False,  # every completion is cut at L; keep them all
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=0,
        # TurnRL's objective: GRPO advantages, token-mean clipped loss, no KL.
        beta=0.0, scale_rewards="group", loss_type="dapo",
        epsilon=cfg.algo.clip_low, epsilon_high=cfg.algo.clip_high,
        learning_rate=cfg.optim.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=cfg.optim.weight_decay, max_grad_norm=cfg.optim.max_grad_norm,
        # No logging, saving or evaluation inside the timed steps.
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
    )


def _serve_trl(conn, meter: PeakRSS) -> None:
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from turnrl.models import load_model

    cmd, arg = conn.recv()
    if cmd != "setup":
        raise BenchError(f"expected setup, got {cmd!r}")
    wl = Workload(**arg)
    if wl.env != "arithmetic" or wl.turns != 1:
        raise BenchError("the TRL side runs the single-turn arithmetic workload only")
    torch.manual_seed(wl.seed)
    model, tokenizer = load_model(wl.model_dir, dtype="float32")
    dataset = Dataset.from_list(trl_prompts(wl, wl.warmup + wl.measured))
    tmp = tempfile.TemporaryDirectory(prefix="turnrl-bench-trl-")
    args = trl_config(wl, tmp.name)

    class Rollout:  # what the wrapped generation methods saw during the current step
        gen_s = generate_s = 0.0
        prompt_lengths: list[int] = []
        completion_lengths: list[int] = []

    class Pacer(TrainerCallback):
        """Times each optimiser step; between blocks, waits for the parent's next command."""

        def __init__(self) -> None:
            self.quota, self.warm, self.records, self.start = wl.warmup, [], [], 0.0
            self.warming, self.base = True, 0.0

        def _handshake(self, control) -> None:
            if self.warming:
                conn.send(("ok", {"warmup_s": self.warm, "rss_loaded_mb": rss_loaded,
                                  "optim": str(args.optim),
                                  "per_device_train_batch_size": args.per_device_train_batch_size,
                                  "gradient_accumulation_steps": args.gradient_accumulation_steps,
                                  "generation_batch_size": args.generation_batch_size}))
                self.warming = False
            else:
                conn.send(("ok", self.records))
                self.records = []
            cmd, n = conn.recv()
            if cmd == "run":
                self.quota = n
            elif cmd == "stop":
                control.should_training_stop = True
                trainer._bench_stopped = True
            else:
                raise BenchError(f"unknown command {cmd!r}")

        def on_train_begin(self, args, state, control, **kwargs):
            torch.set_num_threads(wl.threads)
            if self.quota == 0:
                self._handshake(control)

        def on_step_begin(self, args, state, control, **kwargs):
            Rollout.gen_s = Rollout.generate_s = 0.0
            Rollout.prompt_lengths, Rollout.completion_lengths = [], []
            self.base = meter.reset()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_s = time.perf_counter() - self.start
            if self.warming:
                self.warm.append(step_s)
            else:
                own = trainer._metrics["train"].get("step_time") or [math.nan]
                lengths = Rollout.completion_lengths or [0]
                self.records.append({
                    "step_s": step_s,
                    "gen_s": Rollout.gen_s,
                    "update_s": step_s - Rollout.gen_s,
                    "generate_s": Rollout.generate_s,
                    "trl_step_time_s": own[-1],
                    "completions": len(Rollout.completion_lengths),
                    "completion_tokens": sum(Rollout.completion_lengths),
                    "min_completion_len": min(lengths),
                    "max_completion_len": max(lengths),
                    "prompt_tokens": statistics.fmean(Rollout.prompt_lengths or [0]),
                    "turns": 1.0,
                    "threads": torch.get_num_threads(),
                    "rss_base_mb": self.base,
                    "rss_peak_mb": meter.window_peak_mb(),
                })
            self.quota -= 1
            if self.quota <= 0:
                self._handshake(control)
            return control

    trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=args,
                          train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[Pacer()])
    trainer.remove_callback(PrinterCallback)
    trainer._bench_stopped = False
    rss_loaded = meter.current_mb()

    # Generation time, read from TRL's own methods (its profiling only reaches wandb,
    # mlflow or trackio): the whole rollout (tokenise, generate, decode, reward,
    # advantages) and, inside it, the model.generate call with the token counts it made.
    score = trainer._generate_and_score_completions
    generate = trainer._generate_single_turn

    def timed_score(*a, **k):
        start = time.perf_counter()
        try:
            return score(*a, **k)
        finally:
            Rollout.gen_s += time.perf_counter() - start

    def timed_generate(prompt_ids, *a, **k):
        start = time.perf_counter()
        completion_ids, logprobs = generate(prompt_ids, *a, **k)
        Rollout.generate_s += time.perf_counter() - start
        Rollout.prompt_lengths += [len(p) for p in prompt_ids]
        Rollout.completion_lengths += [len(c) for c in completion_ids]
        return completion_ids, logprobs

    trainer._generate_and_score_completions = timed_score
    trainer._generate_single_turn = timed_generate
    trainer.train()
    if not trainer._bench_stopped:  # ran out of steps before the parent said stop
        cmd, _ = conn.recv()
    conn.send(("ok", {"peak_rss_mb": meter.process_mb()}))
    tmp.cleanup()


# ---- worker processes -----------------------------------------------------------------------


def _worker_main(conn, system: str, threads: int) -> None:
    """Entry point of a worker process (spawned): serve one system until told to stop."""
    os.dup2(2, 1)  # library chatter goes to stderr; the parent's stdout stays the report
    sys.stdout = sys.stderr
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch

        torch.set_num_threads(threads)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        meter = PeakRSS()
        (_serve_turnrl if system.startswith("turnrl") else _serve_trl)(conn, meter)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:  # the parent is gone (it closed the pipe): nothing to report to
            pass
    finally:
        conn.close()


class Worker:
    """A spawned process serving one system; ``ask`` sends a command and waits for its reply."""

    def __init__(self, system: str, threads: int):
        ctx = multiprocessing.get_context("spawn")
        self.system = system
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, system, threads),
                                   name=f"turnrl-bench-{system}")
        self.process.start()
        child.close()

    def ask(self, cmd: str, arg: Any = None) -> Any:
        self.conn.send((cmd, arg))
        while not self.conn.poll(0.5):
            if not self.process.is_alive():
                raise BenchError(f"the {self.system} worker exited (code "
                                 f"{self.process.exitcode}) during '{cmd}'")
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            raise BenchError(f"the {self.system} worker closed its pipe during '{cmd}'") from None
        if kind == "error":
            raise BenchError(f"the {self.system} worker failed during '{cmd}':\n{payload}")
        return payload

    def close(self) -> None:
        """Closing the pipe ends a worker still waiting for a command (after an error)."""
        self.conn.close()
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)


# ---- summaries and printing -----------------------------------------------------------------


def summarize(records: list[dict], final: dict | None = None) -> dict[str, Any]:
    """Medians over measured steps; tokens/s is the median of each step's tokens / seconds."""
    med = statistics.median
    return {
        "steps": len(records),
        "median_step_s": med(r["step_s"] for r in records),
        "completion_tokens_per_s": med(r["completion_tokens"] / r["step_s"] for r in records),
        "median_gen_s": med(r["gen_s"] for r in records),
        "median_update_s": med(r["update_s"] for r in records),
        "completions_per_step": med(r["completions"] for r in records),
        "completion_tokens_per_step": med(r["completion_tokens"] for r in records),
        "completion_len_range": [min(r["min_completion_len"] for r in records),
                                 max(r["max_completion_len"] for r in records)],
        "prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in records),
        "turns": statistics.fmean(r["turns"] for r in records),
        "threads": sorted({r["threads"] for r in records}),
        "step_peak_rss_mb": max(r["rss_peak_mb"] for r in records),
        "step_extra_rss_mb": max(r["rss_peak_mb"] - r["rss_base_mb"] for r in records),
        "peak_rss_mb": (final or {}).get("peak_rss_mb"),
        "records": records,
    }


def _row(cells: Sequence[Any], widths: Sequence[int]) -> str:
    return "  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}"
                     for i, (c, w) in enumerate(zip(cells, widths, strict=True)))


SYSTEM_COLUMNS = ["system", "step s", "tok/s", "gen s", "update s", "peak RSS MB",
                  "step peak MB", "steps (s)"]


def system_rows(results: dict[str, dict]) -> list[list[str]]:
    return [[name, harness.figure(s["median_step_s"], 3), harness.figure(s["completion_tokens_per_s"], 1),
             harness.figure(s["median_gen_s"], 3), harness.figure(s["median_update_s"], 3),
             harness.figure(s["peak_rss_mb"], 0), harness.figure(s["step_peak_rss_mb"], 0),
             " ".join(f"{r['step_s']:.2f}" for r in s["records"])]
            for name, s in results.items()]


def print_table(columns: list[str], rows: list[list[str]], out=None) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows, strict=True)]
    print(_row(columns, widths), file=out)
    for row in rows:
        print(_row(row, widths), file=out)


# ---- orchestration --------------------------------------------------------------------------


def step_rate_ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The ratio of two systems' median completion tokens/s (each step's tokens / seconds)."""
    def rates(summary: dict[str, Any]) -> list[float]:
        return [r["completion_tokens"] / r["step_s"] for r in summary["records"]]
    return harness.ratio_of_medians(rates(a), rates(b))


def split_blocks(steps: int, rounds: int) -> list[int]:
    """``steps`` measured steps as ``rounds`` alternating blocks, as even as possible."""
    rounds = max(1, min(rounds, steps))
    return [steps // rounds + (i < steps % rounds) for i in range(rounds)]


def compare(wl: Workload, systems: Sequence[str], rounds: int) -> dict[str, dict]:
    """Measure ``wl`` on each system: one worker each, warm-up, then ABAB measured blocks."""
    workers: dict[str, Worker] = {}
    setup: dict[str, Any] = {}
    records: dict[str, list] = {s: [] for s in systems}
    finals: dict[str, Any] = {}
    try:
        for system in systems:  # one at a time: a loading worker never overlaps a measured one
            workers[system] = Worker(system, wl.threads)
            own = {"matmul": "torch"} if system == "turnrl-torch" else {}
            setup[system] = workers[system].ask("setup", {**asdict(wl), **own})
        blocks = split_blocks(wl.measured, rounds)
        for index, system in enumerate(harness.round_order(list(systems), len(blocks))):
            records[system] += workers[system].ask("run", blocks[index // len(systems)])
        for system in systems:
            finals[system] = workers[system].ask("stop")
    finally:
        for worker in workers.values():
            worker.close()
    out = {}
    for system in systems:
        out[system] = summarize(records[system], finals[system])
        out[system]["setup"] = setup[system]
    return out


def scaling_workloads(base: Workload, groups: Sequence[int], lengths: Sequence[int],
                      turns: Sequence[int]) -> list[tuple[str, Workload]]:
    rows = [(f"group size {g}", replace(base, group_size=g)) for g in groups]
    rows += [(f"completion length {n}", replace(base, completion_length=n)) for n in lengths]
    guess = replace(base, env="guess-number")
    rows += [(f"turns {t} (guess-number)",
              replace(guess, turns=t, env_options=(("high", 1000), ("max_turns", t))))
             for t in turns]
    return rows


def scaling(rows: list[tuple[str, Workload]]) -> list[dict]:
    """TurnRL only, all rows in one worker; each row reloads the model and warms up again."""
    worker = Worker("turnrl", rows[0][1].threads)
    results, done = [], {}
    try:
        for label, wl in rows:
            if wl not in done:
                worker.ask("setup", asdict(wl))
                done[wl] = summarize(worker.ask("run", wl.measured))
            results.append({"label": label, "group_size": wl.group_size,
                            "completion_length": wl.completion_length, "turns": wl.turns,
                            "env": wl.env, **done[wl]})
        worker.ask("stop")
    finally:
        worker.close()
    return results


def resolve_model_dir(name: str, tmp: Path) -> str:
    """A directory both systems load: the cached SmolLM2 conversion, a saved tiny model, or
    the given Hugging Face directory."""
    from turnrl import models

    if name == models.SMOLLM2:
        return str(models._smollm2_dir(None))
    if name == "tiny":
        model, tokenizer = models.tiny_model(seed=0)
        model.save_pretrained(tmp / "tiny")
        tokenizer.save_pretrained(tmp / "tiny")
        return str(tmp / "tiny")
    if not (Path(name).expanduser() / "config.json").is_file():
        raise BenchError(f"model '{name}' not found; pass 'smollm2-135m-instruct', 'tiny' or "
                         "a local Hugging Face model directory")
    return str(Path(name).expanduser())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/speed/step_throughput.py",
        description="Whole RL steps per second: TurnRL vs TRL's GRPOTrainer, same workload.")
    parser.add_argument("--model", default=None,
                        help="smollm2-135m-instruct (default), tiny, or a local HF model dir")
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 16],
                        help="group sizes (completions per prompt) to compare (default 4 16)")
    parser.add_argument("--completion-length", type=int, default=16,
                        help="tokens per completion, forced in both systems (default 16)")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per step (default 1)")
    parser.add_argument("--steps", type=int, default=None,
                        help="measured steps per system and workload (default 4)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="unmeasured warm-up steps per worker (default 1)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="alternating blocks the measured steps are split into (default 2)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--no-scaling", action="store_true", help="skip the TurnRL scaling table")
    parser.add_argument("--no-limits", action="store_true",
                        help="skip the table of each stage against its hardware floor")
    parser.add_argument("--scaling-steps", type=int, default=None,
                        help="measured steps per scaling row (default 2)")
    parser.add_argument("--scaling-groups", type=int, nargs="+", default=None,
                        help="group sizes of the scaling table (default 4 8 16)")
    parser.add_argument("--scaling-lengths", type=int, nargs="+", default=None,
                        help="completion lengths of the scaling table (default 8 16 32)")
    parser.add_argument("--scaling-turns", type=int, nargs="+", default=None,
                        help="turns of guess-number in the scaling table (default 1 2 4)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--engine", default="hf", choices=("hf", "ct2"),
                        help="TurnRL's sampler (rollout.sampler; default hf)")
    parser.add_argument("--engine-dtype", default="auto",
                        help="TurnRL's sampler precision (rollout.sampler_dtype: auto, int8, "
                             "bfloat16...; default auto)")
    parser.add_argument("--matmul", default="auto", choices=("auto", "torch", "onednn"),
                        help="TurnRL's sampler's products on CPU (sampler.matmul; default auto)")
    parser.add_argument("--compute-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="TurnRL's update precision (optim.compute_dtype; default float32)")
    parser.add_argument("--trl-bf16", action="store_true",
                        help="TRL's bf16 autocast (its bf16=True) for a like-for-like bf16 pair")
    parser.add_argument("--lr", type=float, default=1e-6, help="learning rate (default 1e-6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 1 warm-up and 1 measured step: a smoke test")
    parser.add_argument("--json", metavar="OUT", default=None, help="write all figures here")
    args = parser.parse_args(argv)
    quick = {"model": "tiny", "steps": 1, "warmup": 1, "rounds": 1, "scaling_steps": 1,
             "scaling_groups": [2, 4], "scaling_lengths": [8, 16], "scaling_turns": [1, 2]}
    normal = {"model": "smollm2-135m-instruct", "steps": 4, "warmup": 1, "rounds": 2,
              "scaling_steps": 2, "scaling_groups": [4, 8, 16], "scaling_lengths": [8, 16, 32],
              "scaling_turns": [1, 2, 4]}
    for key, value in (quick if args.quick else normal).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in ("completion_length", "prompts", "steps", "scaling_steps", "threads", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if "trl" in args.systems and min(args.groups) < 2:
        parser.error("TRL's GRPO needs --groups >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    systems = [s for s in SYSTEMS if s in args.systems]
    if "trl" in systems and not trl_available():
        print(TRL_MISSING, file=sys.stderr)
        return 2
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # e.g. saving the tiny model
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if "trl" in systems:
        import trl

        versions += f", trl {trl.__version__}"
    load = harness.load_average()
    report: dict[str, Any] = {"args": vars(args), "versions": versions,
                              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                          "load_average_at_start": load},
                              "workloads": [], "scaling": []}
    try:
        with tempfile.TemporaryDirectory(prefix="turnrl-bench-") as tmp:
            model_dir = resolve_model_dir(args.model, Path(tmp))
            base = Workload(model_dir=model_dir, prompts=args.prompts,
                            completion_length=args.completion_length, lr=args.lr,
                            seed=args.seed, threads=args.threads, warmup=args.warmup,
                            measured=args.steps, engine=args.engine,
                            engine_dtype=args.engine_dtype, matmul=args.matmul,
                            compute_dtype=args.compute_dtype,
                            trl_bf16=args.trl_bf16)
            order = ", ".join(f"{s} {n}" for n in split_blocks(args.steps, args.rounds)
                              for s in systems)
            print(f"step_throughput: {args.model}, arithmetic (seeded, single turn), "
                  f"{args.prompts} prompt(s)/step, completions of exactly "
                  f"{args.completion_length} tokens, float32 weights (TurnRL sampler: "
                  f"{args.engine} {args.engine_dtype}, matmul {args.matmul}, update "
                  f"{args.compute_dtype}; TRL "
                  f"{'bf16 autocast' if args.trl_bf16 else 'float32'}), {args.threads} thread(s), "
                  f"lr {args.lr:g}, no KL, 1 optimiser step per step")
            print(f"each system in its own process: {args.warmup} warm-up step(s), then "
                  f"measured steps in turn ({order}); {versions}; load average {load:.2f}")
            print("gen = prompts to scored completions (TurnRL run_episodes, TRL "
                  "_generate_and_score_completions); update = the rest of the step; peak RSS = "
                  "the system's process, step peak = highest RSS during a measured step")
            ratios = {}
            for group in args.groups:
                wl = replace(base, group_size=group)
                results = compare(wl, systems, args.rounds)
                print()
                print(f"workload G={group}: {args.prompts} x {group} completions x "
                      f"{args.completion_length} tokens = {wl.completions * args.completion_length}"
                      f" completion tokens/step; prompt tokens: " + ", ".join(
                          f"{s} {r['prompt_tokens']:.1f}" for s, r in results.items()))
                print_table(SYSTEM_COLUMNS, system_rows(results))
                for warning in fairness_warnings(wl, results):
                    print(f"warning: {warning}")
                entry = {"group_size": group, "workload": asdict(wl), "systems": results}
                if "turnrl" in systems and "trl" in systems:
                    ratio = step_rate_ratio(results["turnrl"], results["trl"])
                    ratios[f"G={group}"] = entry["ratio"] = ratio
                    print(f"ratio (G={group}): {RATIO} = {ratio:.2f}")
                if "turnrl" in systems and "turnrl-torch" in systems:
                    print(f"ratio (G={group}): turnrl/turnrl-torch completion tokens per "
                          "second = " + harness.figure(
                              step_rate_ratio(results["turnrl"], results["turnrl-torch"])))
                report["workloads"].append(entry)

            if not args.no_limits and "turnrl" in systems:
                print_limits(model_dir, args.threads, report)

            if not args.no_scaling and "turnrl" in systems:
                rows = scaling_workloads(replace(base, measured=args.scaling_steps),
                                         args.scaling_groups, args.scaling_lengths,
                                         args.scaling_turns)
                report["scaling"] = scaling(rows)
                print()
                print(f"TurnRL scaling ({args.model}, {args.prompts} prompt(s)/step, median of "
                      f"{args.scaling_steps} step(s) after {args.warmup} warm-up; base G=4, "
                      f"L={args.completion_length}, 1 turn of arithmetic):")
                print_table(
                    ["varied", "G", "L", "turns", "tokens", "step s", "gen s", "update s",
                     "tok/s", "step peak MB"],
                    [[r["label"], r["group_size"], r["completion_length"], harness.figure(r["turns"], 1),
                      harness.figure(r["completion_tokens_per_step"], 0), harness.figure(r["median_step_s"], 3),
                      harness.figure(r["median_gen_s"], 3), harness.figure(r["median_update_s"], 3),
                      harness.figure(r["completion_tokens_per_s"], 1), harness.figure(r["step_peak_rss_mb"], 0)]
                     for r in report["scaling"]])
    except BenchError as err:
        print(f"step_throughput: error: {err}", file=sys.stderr)
        return 1

    if ratios:
        report["ratio"] = min(ratios.values())
        report["ratio_over"] = list(ratios)
        print()
        print(f"final ratio = minimum over workloads {', '.join(ratios)} "
              f"(median completion tokens/s each)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(harness.machine(load))
    print(harness.ratio_line(RATIO, report["ratio"] if ratios else "n/a (TRL not run)"))
    return 0


def print_limits(model_dir: str, threads: int, report: dict[str, Any]) -> None:
    """TurnRL's generation and update against their floors (``hardware_limits.py``): memory
    bandwidth and peak matmul rate measured now, with every worker idle."""
    sys.path.insert(0, str(Path(__file__).parent))
    import hardware_limits

    rates = hardware_limits.measure_rates(threads)
    report["rates"] = asdict(rates)
    print()
    print(f"TurnRL against the hardware ({threads} thread(s), measured now: memory read "
          f"{rates.read_gb_s:.1f} GB/s, matmul float32 {rates.fp32_gflops:.0f} GFLOP/s, "
          f"bfloat16 {rates.bf16_gflops:.0f} GFLOP/s):")
    print_table(["stage", "measured s", "floor s", "x floor", "floor from"],
                hardware_limits.limits_table(hardware_limits.model_size(model_dir), rates,
                                             report["workloads"]))


def fairness_warnings(wl: Workload, results: dict[str, dict]) -> list[str]:
    """Departures from the intended workload that would make the comparison unfair."""
    warnings, expected = [], wl.completions * wl.completion_length * wl.turns
    for system, r in results.items():
        if r["completion_tokens_per_step"] != expected:
            warnings.append(f"{system} generated {r['completion_tokens_per_step']:.0f} completion "
                            f"tokens per step, not {expected} (lengths "
                            f"{r['completion_len_range'][0]}-{r['completion_len_range'][1]})")
        if any(t != wl.threads for t in r["threads"]):
            warnings.append(f"{system} ran with {r['threads']} torch threads, not {wl.threads}")
    prompts = {s: round(r["prompt_tokens"], 1) for s, r in results.items()}
    if len(set(prompts.values())) > 1:
        warnings.append(f"prompt lengths differ between systems: {prompts}")
    return warnings


if __name__ == "__main__":
    sys.exit(main())
