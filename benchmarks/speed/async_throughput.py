"""Sync vs async training on one multi-turn task whose tool calls take heavy-tailed latency.

The workload: ``guess-number`` behind the ``slow`` wrapper (turnrl/envs/latency.py), whose every
step first awaits a log-normal delay (median 0, 100 or 500 ms, shape ``--sigma`` 1.0: one step
in a hundred takes 10x the median). For each model and latency the same training job (same
seeds, group size, groups per step, tokens per turn, learning rate, algorithm) runs twice,
each for the same wall-time budget (``--seconds``, counted from the first training step;
model loading and Ray start-up are not in it):

- **sync** (``run.mode sync``): collect a step's episodes, then update; 2 torch threads. Its
  environment steps within a turn already run concurrently (``asyncio.gather``), so the
  baseline is the fair one: it waits, per turn, for the slowest of its episodes' tools;
- **async** (``run.mode async``): a local 2-CPU Ray cluster, one rollout worker (1 thread,
  ``ray.worker_cpus 1``) running the continuous turn loop, the learner in the driver
  (1 thread), decoupled PPO, bounded staleness, partial rollouts. Same 2 cores.

Measured per run, from the learner's metrics.jsonl (``time/*_s``, ``episode/tokens``, ...)
plus a little instrumentation of the run's own process (generate-call time, the workers'
loop counters): trained episodes/s and trained tokens/s (tokens, prompt and environment
text included, of the episodes the updates actually used), in steady state (from the end
of step 1 to the end of the last step, so neither mode is charged its warm-up or the async
pipeline fill; the whole-budget rate is in the JSON too); where the wall time went (sync:
generation / waiting on tools / update; async: learner waiting for groups / proximal pass /
update, and how busy the rollout worker was); staleness; reward: of the training episodes
(at the same number of trained episodes, and over the last quarter of the run) and of
``--eval-episodes`` held-out episodes played without latency by the weights the budget ended
with. The last line is ``ratio: async at 500 ms / best at 0 ms trained tokens per second =
X`` (SmolLM2 if it ran, else tiny; the line above says which).

Fairness: both modes get the same 2 cores (sync: one process, 2 threads; async: 1 + 1
threads, Ray's own processes on top, their cost counted against async). A small model may
run faster on 1 thread than on 2 (and a loaded machine makes 2 threads much slower), so at
0 ms the sync trainer also runs on 1 thread (``sync1``; ``--no-sync1`` skips it) and "best
at 0 ms" is the best of all zero-latency runs. The async learner sizes itself by
default (``pool.auto``, turnrl/distributed/sizing.py): the pool of live episodes from
Little's law (the rate the learner consumes x the measured tool latency and generate-call
time), the staleness bound from the measured group lifetime x the learner's step rate,
capped by the importance weights' ESS; nothing is tuned per model or machine here.
``--overprovision`` / ``--max-versions`` / ``--queued-groups`` with a number pin them by hand
(``pool.auto false``). Groups too stale on arrival are dropped and counted (their
generation was wasted), and "reward @same eps" checks that the extra staleness does not
cost reward per trained episode. ``--compare-kv-cache`` adds an async run with the other
``sampler.keep_kv_cache`` policy at every latency (mode ``async-keepkv`` or
``async-dropkv``), side by side with the default one. Runs are
interleaved (sync, async per latency) so drifting machine load hits both; each run is its
own process. ``--repeats N`` plays everything N times, every other time with the latencies
in reverse order, and prints the median of each ratio over the repeats with the N values
(one run of the tiny model moves by about 10% on a 2-core machine; the ratio by ±0.07).

Usage: ``python benchmarks/speed/async_throughput.py [--models tiny smollm2-135m-instruct]
[--latencies 0 100 500] [--seconds S] [--repeats N] [--out FILE.json]``; ``--quick`` runs the
tiny model with short budgets (a smoke check). ``--help`` lists every flag. The alternation,
the machine line and the ``ratio:`` line are the shared harness's (``benchmarks/harness.py``),
the job's config keys ``training_job.py``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from training_job import job_keys  # benchmarks/speed/, this folder
from training_job import overrides as as_overrides

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

DEFAULT_SECONDS = {"tiny": 90.0, "smollm2-135m-instruct": 300.0}
DEFAULT_LR = {"tiny": 1e-3, "smollm2-135m-instruct": 4e-5}
@dataclass
class RunSpec:
    """One training run: everything its child process needs."""

    model: str
    mode: str
    """"sync", "sync1" (sync on 1 thread), "async", or "before" (evaluate the initial weights)"""
    median_ms: float
    seconds: float
    out_dir: str
    env: str = "guess-number"
    env_options: dict[str, Any] = field(default_factory=dict)
    sigma: float = 1.0
    group_size: int = 8
    groups_per_step: int = 4
    max_new_tokens: int = 8
    max_turns: int = 8
    lr: float = 4e-5
    seed: int = 0
    threads: int = 2
    overprovision: float | None = None
    """None (with max_versions and queued_groups None): pool.auto sizes them"""
    max_versions: int | None = None
    queued_groups: int | None = None
    keep_kv_cache: bool | None = None
    """None: the config's default policy"""
    eval_episodes: int = 64
    timeout_s: float = 1800.0

    @property
    def is_async(self) -> bool:
        return self.mode.startswith("async")

    def overrides(self) -> list[str]:
        slow = {"env": self.env, "median_ms": self.median_ms, "sigma": self.sigma,
                "seed": self.seed, "options": self.env_options}
        # evaluated here, after the budget (job_keys: eval.episodes 0)
        args = job_keys(
            self.model, "slow", group_size=self.group_size,
            groups_per_step=self.groups_per_step, max_new_tokens=self.max_new_tokens,
            seed=self.seed, env_options=slow, max_turns=self.max_turns, lr=self.lr,
            # sync: all the threads; async: one worker with 1 CPU, the learner the rest
            threads=self.threads - 1 if self.is_async
            else {"sync1": 1}.get(self.mode, self.threads))
        args.update({
            "run.out_dir": self.out_dir,
            "run.steps": 100_000,  # the wall-time budget ends the run, not the step count
            "run.sample_episodes": 0, "run.mode": "async" if self.is_async else "sync",
            "ray.num_workers": 1, "ray.worker_cpus": 1})
        pinned = {"pool.overprovision": self.overprovision,
                  "staleness.max_versions": self.max_versions,
                  "pool.queued_groups": self.queued_groups}
        args.update({k: v for k, v in pinned.items() if v is not None})
        if any(v is not None for v in pinned.values()):
            args["pool.auto"] = False  # a number given by hand is used as is
        if self.keep_kv_cache is not None:
            args["sampler.keep_kv_cache"] = self.keep_kv_cache
        return as_overrides(args)


# ---- the child: one run in its own process ----------------------------------------------------


class BudgetReached(Exception):
    """Raised from the metrics logger once the wall-time budget is spent."""


def run_child(spec: RunSpec) -> dict[str, Any]:
    """Train for ``spec.seconds`` of wall time, then evaluate; every number the parent needs.

    Instrumentation, all in this process: the trainers' ``MetricsLogger`` is swapped for one
    that timestamps every step and stops the run at the budget; ``load_policy`` is wrapped to
    keep the model for the evaluation after it; ``HFEngine.generate`` is timed (the sync
    trainer generates here); the async learner's fleet is kept to read the workers' loop
    counters, which it receives with every poll but does not log.
    """
    import torch

    import turnrl.distributed.source as source_mod
    import turnrl.trainer.bookkeeping as bookkeeping_mod
    import turnrl.trainer.local as sync_mod
    import turnrl.trainer.run as run_mod
    from turnrl.config import load_config
    from turnrl.envs import make_env
    from turnrl.evaluation import evaluate
    from turnrl.metrics import MetricsLogger
    from turnrl.samplers import SamplingParams
    from turnrl.samplers.hf import HFEngine

    cfg = load_config(None, spec.overrides())
    result: dict[str, Any] = {"spec": asdict(spec), "records": [], "error": None}
    captured: dict[str, Any] = {"gen_s": 0.0, "gen_calls": 0, "gen_rows": 0}

    generate = HFEngine.generate

    def timed_generate(self, prompts, params):
        start = time.perf_counter()
        try:
            return generate(self, prompts, params)
        finally:
            captured["gen_s"] += time.perf_counter() - start
            captured["gen_calls"] += 1
            captured["gen_rows"] += len(prompts)

    HFEngine.generate = timed_generate

    load_policy = run_mod.load_policy

    def keep_policy(cfg):
        captured["policy"] = load_policy(cfg)
        return captured["policy"]

    run_mod.load_policy = keep_policy

    class KeptFleet(source_mod.Fleet):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            captured["fleet"] = self

    source_mod.Fleet = KeptFleet

    class BudgetLogger(MetricsLogger):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # Created right before the first step, after model load, Ray start-up and the
            # workers' start: the budget counts training only.
            captured["t0"] = time.perf_counter()
            captured["gen_at_t0"] = captured["gen_s"]
            result["loadavg_at_start"] = harness.load_average()

        def log(self, step, metrics):
            super().log(step, metrics)
            fleet = captured.get("fleet")
            workers = dict(fleet.stats.get(0, {})) if fleet is not None else {}
            elapsed = time.perf_counter() - captured["t0"]
            result["records"].append({
                "step": step, "t": elapsed, "metrics": dict(metrics), "worker": workers,
                "driver_gen_s": captured["gen_s"] - captured["gen_at_t0"],
                "driver_gen_calls": captured["gen_calls"],
                "driver_gen_rows": captured["gen_rows"]})
            if elapsed >= spec.seconds:
                # Other processes on the machine skew everything (and 2 torch threads on 2
                # busy cores far more than 1): the 1-minute load average says how busy it was.
                result["loadavg_at_end"] = harness.load_average()
                raise BudgetReached

    bookkeeping_mod.MetricsLogger = BudgetLogger

    ray = None
    if spec.mode.startswith("async"):
        import ray

        # The same 2 CPUs as the sync run: one for the worker, one for the learner.
        ray.init(num_cpus=spec.threads, include_dashboard=False, log_to_driver=False)
    try:
        if spec.mode == "before":
            captured["policy"] = keep_policy(cfg)
        elif spec.mode in ("sync", "sync1"):
            sync_mod.train(cfg)
        else:
            from turnrl.launch import train_async

            train_async(cfg)
        if spec.mode != "before":
            result["error"] = "the run ended before its budget (run.steps too small)"
    except BudgetReached:
        pass
    except Exception as err:  # noqa: BLE001 - reported by the parent, next to the figures
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(err).__name__}: {err}"
    finally:
        if ray is not None and ray.is_initialized():
            ray.shutdown()

    policy = captured.get("policy")
    if spec.eval_episodes and policy is not None and result["error"] is None:
        # Held-out seeds, the inner env without latency (the latency changes nothing the
        # policy sees), all threads, after the workers are gone.
        torch.set_num_threads(spec.threads)
        params = SamplingParams(cfg.rollout.max_new_tokens, cfg.eval.temperature,
                                cfg.rollout.top_p, stop_token_ids=(policy.chat.end_of_turn,))
        seeds = list(range(cfg.eval.seed_offset, cfg.eval.seed_offset + spec.eval_episodes))
        started = time.perf_counter()
        evaluation, _ = evaluate(lambda: make_env(spec.env, **spec.env_options), seeds,
                                 policy.engine, policy.chat, params, env_name=spec.env,
                                 max_turns=cfg.rollout.max_turns, max_context=policy.max_context)
        result["eval"] = {**evaluation.to_dict(), "seconds": time.perf_counter() - started}
    return result


# ---- the parent: summaries, tables, ratios -----------------------------------------------------


def _sum(records: list[dict], key: str) -> float:
    return sum(r["metrics"].get(key) or 0.0 for r in records)


def summarize_run(raw: dict[str, Any]) -> dict[str, Any]:
    """Throughput, time split, staleness and reward of one run, from its step records."""
    spec, records = raw["spec"], raw["records"]
    per_step = spec["group_size"] * spec["groups_per_step"]
    out: dict[str, Any] = {"model": spec["model"], "mode": spec["mode"],
                           "median_ms": spec["median_ms"], "error": raw.get("error"),
                           "steps": len(records), "eval": raw.get("eval"),
                           "loadavg": [raw.get("loadavg_at_start"), raw.get("loadavg_at_end")]}
    if not records:
        return out
    n = len(records)
    tokens = [r["metrics"]["episode/tokens"] * per_step for r in records]
    policy_tokens = [r["metrics"]["episode/policy_tokens"] * per_step for r in records]
    wall = records[-1]["t"]
    # Steady state: steps 2..n over the time from the end of step 1 to the end of step n.
    window = records[1:] if n >= 2 else records
    span = wall - records[0]["t"] if n >= 2 else wall
    out.update({
        "wall_s": wall, "episodes": n * per_step, "steady_span_s": span,
        "steady_steps": len(window),
        "episodes_per_s": len(window) * per_step / span,
        "tokens_per_s": sum(tokens[n - len(window):]) / span,
        "policy_tokens_per_s": sum(policy_tokens[n - len(window):]) / span,
        "episodes_per_s_whole": n * per_step / wall,
        "tokens_per_s_whole": sum(tokens) / wall,
        "step_s_median": statistics.median(r["metrics"]["time/step_s"] for r in window),
        "turns_mean": statistics.fmean(r["metrics"]["episode/turns"] for r in records),
        "tokens_per_episode": sum(tokens) / (n * per_step),
    })
    # Where the steady-state wall time went (fractions of the window's span).
    if not spec["mode"].startswith("async"):
        gen = records[-1]["driver_gen_s"] - (records[0]["driver_gen_s"] if n >= 2 else 0.0)
        collect = _sum(window, "time/collect_s")
        rows = records[-1]["driver_gen_rows"] - (records[0]["driver_gen_rows"] if n >= 2 else 0)
        calls = records[-1]["driver_gen_calls"] - (records[0]["driver_gen_calls"] if n >= 2
                                                   else 0)
        out["generation"] = {"busy": gen / span, "rows_per_call": rows / max(calls, 1),
                             "ms_per_row": 1000 * gen / max(rows, 1)}
        out["split"] = {
            "generate": gen / span,
            "env wait": max(0.0, collect - gen) / span,
            "update": (_sum(window, "time/update_s") + _sum(window, "time/advantages_s")
                       + _sum(window, "time/score_s")) / span,
            "other": max(0.0, span - collect - _sum(window, "time/update_s")
                         - _sum(window, "time/advantages_s")
                         - _sum(window, "time/score_s")) / span,
        }
    else:
        wait = _sum(window, "time/wait_s")
        learner = {k: _sum(window, f"time/{k}_s") for k in
                   ("proximal", "update", "publish", "advantages", "score", "log")}
        out["split"] = {
            "learner wait": wait / span,
            "proximal": learner["proximal"] / span,
            "update": (learner["update"] + learner["advantages"] + learner["score"]) / span,
            "publish": learner["publish"] / span,
        }
        first, last = (records[0]["worker"], records[-1]["worker"]) if n >= 2 \
            else ({}, records[-1]["worker"])
        if last:
            def delta(key: str) -> float:
                return last.get(key, 0.0) - first.get(key, 0.0)
            calls = max(delta("generate_calls"), 1)
            out["generation"] = {
                "busy": delta("generate_s") / span,
                "rows_per_call": delta("generated_rows") / calls,
                "ms_per_row": 1000 * delta("generate_s") / max(delta("generated_rows"), 1),
                "calls_per_s": delta("generate_calls") / span,
                "overlapped_calls": delta("overlapped_calls") / calls,
                "version_swaps": delta("version_swaps"),
                "max_live": last.get("max_live", 0),
                "mean_live": delta("live_at_calls") / calls,
                "episodes_finished": last.get("episodes_finished", 0),
            }
        out["staleness"] = {
            "mean": statistics.fmean(r["metrics"]["async/staleness_mean"] for r in records),
            "max": max(r["metrics"]["async/staleness_max"] for r in records),
            "dropped_groups": _sum(records, "async/dropped_groups"),
            "dropped_fraction": _sum(records, "async/dropped_groups")
            / max(1.0, _sum(records, "async/dropped_groups") + n * spec["groups_per_step"]),
            "mixed_version_episodes": statistics.fmean(
                r["metrics"]["async/mixed_version_episodes"] for r in records),
            "ess": statistics.fmean(r["metrics"].get("offpolicy/ess") or 1.0 for r in records),
            "group_lifetime_s": statistics.fmean(
                r["metrics"].get("async/group_lifetime_s", 0.0) for r in window),
        }
        last_metrics = records[-1]["metrics"]
        out["sizing"] = {k: last_metrics.get(k) for k in (
            "sizing/pool", "sizing/queued_groups", "sizing/max_versions", "sizing/ess_ceiling",
            "rates/env_latency_median_s", "rates/env_latency_p90_s", "rates/gen_rows_per_s",
            "rates/gen_capacity_rows_per_s", "rates/learner_steps_per_s",
            "rates/group_lifetime_s")}
        # Versions the learner advances while one group plays: the staleness this throughput
        # needs the bound to allow (groups past the bound are dropped).
        out["staleness"]["lifetime_versions"] = (out["staleness"]["group_lifetime_s"]
                                                 / out["step_s_median"])
    rewards = [r["metrics"]["reward/mean"] for r in records]
    quarter = rewards[-max(1, n // 4):]
    out["train_reward_last_quarter"] = statistics.fmean(quarter)
    out["train_success_last_quarter"] = statistics.fmean(
        r["metrics"]["success/rate"] for r in records[-len(quarter):])
    out["reward_curve"] = [[r["step"] * per_step, r["t"], r["metrics"]["reward/mean"]]
                           for r in records]
    return out


def reward_at(summary: dict[str, Any], episodes: int) -> float | None:
    """Mean training reward of the trained episodes in (episodes / 2, episodes]."""
    points = [reward for count, _, reward in summary.get("reward_curve", [])
              if episodes / 2 < count <= episodes]
    return statistics.fmean(points) if points else None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x: float | None, digits: int = 1) -> str:
    return harness.figure(x, digits)


COLUMNS = ["lat ms", "mode", "steps", "wall s", "ep/s", "tok/s", "vs best 0ms", "time split",
           "gen busy / rows per call / ms per row / live (async: mean, max)",
           "stale mean/max, dropped; group lifetime (s = versions)", "reward @same eps",
           "train reward last 1/4", "eval success after budget"]


def model_table(model: str, runs: list[dict[str, Any]], before: dict | None) -> tuple[str, dict]:
    """One table per model; returns it as text and the ratios it implies."""
    from rich.console import Console

    from turnrl.metrics import print_table

    ok = [r for r in runs if r.get("tokens_per_s")]
    zero = [r["tokens_per_s"] for r in ok if r["median_ms"] == 0]
    best0 = max(zero) if zero else None
    rows = []
    by = {(r["median_ms"], r["mode"]): r for r in runs}
    for r in runs:
        # Reward compared at the number of episodes every run at this latency trained on.
        same = min((p["episodes"] for p in runs
                    if p["median_ms"] == r["median_ms"] and p.get("episodes")), default=0)
        split = ", ".join(f"{k} {_pct(v)}" for k, v in r.get("split", {}).items())
        gen = r.get("generation")
        stale = r.get("staleness")
        ev = r.get("eval")
        rows.append([
            f"{r['median_ms']:g}", r["mode"], str(r.get("steps", 0)), _num(r.get("wall_s"), 0),
            _num(r.get("episodes_per_s"), 2), _num(r.get("tokens_per_s"), 0),
            _num(r["tokens_per_s"] / best0, 2) if best0 and r.get("tokens_per_s") else "-",
            split or (r.get("error") or "-"),
            f"{_pct(gen['busy'])} / {gen['rows_per_call']:.0f} / {gen['ms_per_row']:.1f}"
            + (f" / {gen['mean_live']:.0f}, {gen['max_live']:.0f}" if "mean_live" in gen else "")
            if gen else "-",
            f"{stale['mean']:.2f}/{stale['max']:.0f}, {stale['dropped_groups']:.0f}; "
            f"{stale['group_lifetime_s']:.1f} s = {stale['lifetime_versions']:.1f} v"
            if stale else "-",
            f"{_num(reward_at(r, same), 3)} @{same}" if same else "-",
            _num(r.get("train_reward_last_quarter"), 3),
            f"{100 * ev['success_rate']:.1f}% ({ev['mean_reward']:.3f})" if ev else "-",
        ])
    title = f"{model}: sync vs async, same wall-time budget per run"
    if before:
        title += (f" (held-out success before training {100 * before['success_rate']:.1f}%,"
                  f" reward {before['mean_reward']:.3f})")
    # Wide and colourless: the table must not wrap in a narrow terminal or a log file.
    text = print_table(title, COLUMNS, rows,
                       console=Console(width=260, color_system=None, soft_wrap=True))
    ratios = {}
    for r in ok:
        if best0:
            ratios[f"{r['mode']} at {r['median_ms']:g} ms / best at 0 ms"] = \
                r["tokens_per_s"] / best0
    for ms in sorted({r["median_ms"] for r in ok}):
        s, a = by.get((ms, "sync")), by.get((ms, "async"))
        if s and a and s.get("tokens_per_s") and a.get("tokens_per_s"):
            ratios[f"async / sync at {ms:g} ms"] = a["tokens_per_s"] / s["tokens_per_s"]
    return text, ratios


def run_spec(spec: RunSpec, workdir: Path) -> dict[str, Any]:
    """Run one spec in a fresh process; its output goes to a log file next to its run dir."""
    spec_path = workdir / f"{Path(spec.out_dir).name}.spec.json"
    result_path = workdir / f"{Path(spec.out_dir).name}.result.json"
    log_path = workdir / f"{Path(spec.out_dir).name}.log"
    spec_path.write_text(json.dumps(asdict(spec)))
    started = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", str(spec_path),
                                   str(result_path)], stdout=log, stderr=subprocess.STDOUT,
                                  timeout=spec.timeout_s)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if result_path.exists():
        raw = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text()[-2000:]
        raw = {"spec": asdict(spec), "records": [],
               "error": f"child exited with {code}; log {log_path}: ...{tail[-300:]}"}
    raw["process_s"] = time.perf_counter() - started
    raw["log"] = str(log_path)
    return raw


def _sizing_note(summary: dict[str, Any]) -> str:
    """Where pool.auto ended: pool, queue, bound, and the rates it read."""
    sizing = summary.get("sizing") or {}
    if sizing.get("sizing/pool") is None:
        return ""
    return (f"; auto: pool {sizing['sizing/pool']:.0f}, queue {sizing['sizing/queued_groups']:.0f}"
            f"/worker, bound {sizing['sizing/max_versions']:.0f} (env median "
            f"{_num(sizing['rates/env_latency_median_s'], 3)} s, p90 "
            f"{_num(sizing['rates/env_latency_p90_s'], 3)} s; generation "
            f"{_num(sizing['rates/gen_rows_per_s'], 0)} rows/s, capacity "
            f"{_num(sizing['rates/gen_capacity_rows_per_s'], 0)}; learner "
            f"{_num(sizing['rates/learner_steps_per_s'], 2)} steps/s; group lifetime "
            f"{_num(sizing['rates/group_lifetime_s'], 1)} s)")


def _schedule(latencies: list[float], repeats: int) -> list[tuple[int, float]]:
    """(repeat, latency) in the order to run: every other repeat backwards, so a machine
    that drifts during the runs weighs on every latency alike."""
    order = harness.round_order(list(latencies), max(repeats, 1), flip=True)
    return [(index // len(latencies), ms) for index, ms in enumerate(order)]


def _pinned(value: str, kind: type) -> Any:
    """A flag's number, or None for 'auto' (the run-time controller decides)."""
    return None if value == "auto" else kind(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m-instruct"])
    parser.add_argument("--latencies", nargs="+", type=float, default=[0, 100, 500],
                        help="median tool latencies in ms (log-normal)")
    parser.add_argument("--modes", nargs="+", default=["sync", "async"],
                        choices=["sync", "sync1", "async"],
                        help="sync1: the sync trainer on 1 thread (a second sync baseline: "
                             "on a small model 2 threads may not beat 1)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="wall-time budget per run (default: tiny 90, smollm2 300)")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal shape")
    parser.add_argument("--env", default="guess-number", help="inner (multi-turn) environment")
    parser.add_argument("--env-options", default="{}", help="inner env options, JSON")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: tiny 1e-3, smollm2 4e-5)")
    parser.add_argument("--threads", type=int, default=2,
                        help="cores per run: sync threads; async 1 worker + the rest learner")
    parser.add_argument("--overprovision", default="auto",
                        help="async groups in flight per step's need; 'auto' (default): sized "
                             "at run time by pool.auto; a number pins it")
    parser.add_argument("--max-versions", default="auto",
                        help="async staleness bound (versions); 'auto' (default): sized at "
                             "run time by pool.auto; a number pins it")
    parser.add_argument("--queued-groups", default="auto",
                        help="async groups queued at the worker beyond its pool; 'auto' "
                             "(default): sized at run time; a number pins it")
    parser.add_argument("--keep-kv-cache", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="async workers keep (or, --no-keep-kv-cache, drop) their keys/"
                             "values across weight updates (sampler.keep_kv_cache, "
                             "PipelineRL's in-flight update); default: the config's")
    parser.add_argument("--compare-kv-cache", action="store_true",
                        help="also run async with the other keep_kv_cache policy at every "
                             "latency, side by side (mode async-keepkv or async-dropkv)")
    parser.add_argument("--no-sync1", action="store_true",
                        help="skip the extra 1-thread sync run at 0 ms (by default it runs, "
                             "so 'best at 0 ms' is the best of sync on 1 and 2 threads and "
                             "async)")
    parser.add_argument("--eval-episodes", type=int, default=64,
                        help="held-out episodes after each run's budget (0 = none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="play every run N times, the latencies in alternating order; "
                             "the ratios printed are the medians over the repeats (one run "
                             "moves by about 10%% on a 2-core machine)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model only, 25 s budgets, 16 eval episodes: a smoke check "
                             "of the script; budgets this short give no steady-state figures")
    parser.add_argument("--out", default="async_throughput.json", help="raw figures (JSON)")
    parser.add_argument("--workdir", default="", help="run directories and logs (default: tmp)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        spec = RunSpec(**json.loads(Path(args.child[0]).read_text()))
        result = run_child(spec)
        Path(args.child[1]).write_text(json.dumps(result))
        return 0

    if args.quick:
        args.models = ["tiny"]
        args.seconds = args.seconds or 25.0
        args.eval_episodes = min(args.eval_episodes, 16)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="async-throughput-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env_options = json.loads(args.env_options)
    print(f"workload: {args.env} {env_options or ''} behind log-normal tool latency "
          f"(sigma {args.sigma}), group {args.group_size} x {args.groups_per_step} groups/step, "
          f"{args.max_new_tokens} new tokens/turn, {args.threads} cores per run "
          f"(os.cpu_count {os.cpu_count()}); runs and logs in {workdir}", flush=True)

    started, load = time.perf_counter(), harness.load_average()
    report: dict[str, Any] = {"args": vars(args), "models": {}}
    texts, all_ratios = [], {}
    for model in args.models:
        seconds = args.seconds or DEFAULT_SECONDS.get(model, 300.0)
        lr = args.lr or DEFAULT_LR.get(model, 4e-5)

        def spec(mode: str, median_ms: float, repeat: int = 0, model=model, seconds=seconds,
                 lr=lr) -> RunSpec:
            tag = f"{model}-{mode}-{median_ms:g}ms" + (f"-r{repeat}" if repeat else "")
            keep = args.keep_kv_cache
            if mode in ("async-keepkv", "async-dropkv"):
                keep = mode == "async-keepkv"
            return RunSpec(model=model, mode=mode, median_ms=median_ms, seconds=seconds,
                           out_dir=str(workdir / tag), env=args.env, env_options=env_options,
                           sigma=args.sigma, group_size=args.group_size,
                           groups_per_step=args.groups_per_step,
                           max_new_tokens=args.max_new_tokens, lr=lr, seed=args.seed,
                           threads=args.threads,
                           overprovision=_pinned(args.overprovision, float),
                           max_versions=_pinned(args.max_versions, int),
                           queued_groups=_pinned(args.queued_groups, int),
                           keep_kv_cache=keep,
                           eval_episodes=args.eval_episodes,
                           timeout_s=max(600.0, 4 * seconds + 600))

        before = None
        if args.eval_episodes:
            raw = run_spec(spec("before", 0), workdir)
            before = raw.get("eval")
            print(f"[{model}] before training: {json.dumps(before)}", flush=True)
        raws, summaries = [], []
        by_repeat: list[list[dict[str, Any]]] = [[] for _ in range(max(args.repeats, 1))]
        for repeat, median_ms in _schedule(args.latencies, args.repeats):
            modes = list(args.modes)
            if median_ms == 0 and not args.no_sync1 and "sync1" not in modes:
                modes.insert(1, "sync1")
            if args.compare_kv_cache and "async" in modes:
                from turnrl.config import load_config

                default_keep = (load_config(None, []).sampler.keep_kv_cache
                                if args.keep_kv_cache is None else args.keep_kv_cache)
                modes.append("async-dropkv" if default_keep else "async-keepkv")
            for mode in modes:
                raw = run_spec(spec(mode, median_ms, repeat), workdir)
                summary = summarize_run(raw)
                raws.append(raw)
                summaries.append(summary)
                by_repeat[repeat].append(summary)
                print(f"[{model}{f' r{repeat}' if args.repeats > 1 else ''}] {mode} "
                      f"{median_ms:g} ms: {summary.get('steps', 0)} steps, "
                      f"{_num(summary.get('tokens_per_s'), 0)} tok/s, "
                      f"{_num(summary.get('episodes_per_s'), 2)} ep/s"
                      + (f", error: {summary['error']}" if summary.get("error") else "")
                      + _sizing_note(summary)
                      + f" ({raw['process_s']:.0f} s in all; load average "
                      f"{_num(raw.get('loadavg_at_start'))} -> {_num(raw.get('loadavg_at_end'))})",
                      flush=True)
        per_repeat = []
        for runs in by_repeat:
            text, ratios = model_table(model, runs, before)
            texts.append(text)
            per_repeat.append(ratios)
        ratios = {name: statistics.median(r[name] for r in per_repeat)
                  for name in per_repeat[0] if all(name in r for r in per_repeat)}
        all_ratios[model] = ratios
        report["models"][model] = {"seconds": seconds, "lr": lr, "before": before,
                                   "runs": summaries, "raw": raws, "ratios": ratios,
                                   "ratios_per_repeat": per_repeat}
        Path(args.out).write_text(json.dumps(report, indent=1))

    print()
    loads = [x for m in report["models"].values() for r in m["runs"]
             for x in r.get("loadavg", []) if x is not None]
    if loads and max(loads) > 1.5 * (os.cpu_count() or 1):
        # A run alone keeps about cpu_count threads busy (async: a few more, briefly), so
        # well above that means other processes.
        print(f"WARNING: the 1-minute load average reached {max(loads):.1f} on "
              f"{os.cpu_count()} cores during the runs: other processes took CPU (2-thread "
              "torch runs suffer most); the figures below are not clean, rerun on a quiet "
              "machine")
    for model, ratios in all_ratios.items():
        each = report["models"][model]["ratios_per_repeat"]
        for name, value in ratios.items():
            spread = (f" (median of {len(each)}: "
                      f"{', '.join(f'{r[name]:.2f}' for r in each)})" if len(each) > 1 else "")
            print(f"{model}: {name} trained tokens/s = {value:.2f}{spread}")
    report["wall_s"] = time.perf_counter() - started
    headline = next((m for m in ("smollm2-135m-instruct", "tiny") if m in all_ratios), None)
    key = "async at 500 ms / best at 0 ms"
    value = all_ratios.get(headline, {}).get(key) if headline else None
    report["headline"] = {"model": headline, "ratio": value}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"total wall time {report['wall_s'] / 60:.1f} min; raw figures in {args.out}")
    print(f"headline model: {headline} (ratio below; goal >= 0.8)")
    print(harness.machine(load))
    print(harness.ratio_line(f"{key} trained tokens per second", _num(value, 2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
