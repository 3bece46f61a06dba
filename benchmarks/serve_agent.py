"""The shipped ReAct agent (examples/openai_agent.py) trained through the endpoint: before/after.

The agent is written only against the ``openai`` client: a system prompt, a ``multiply``
tool, up to 3 turns; reward 1 when its last reply contains the product of two 3-digit
numbers. The offline SmolLM2-135M-Instruct, behind ``turnrl serve``, writes prose instead of
a tool call (0 of 32 measured), so GRPO would see only zero rewards. As in
benchmarks/tool_task.py, the run has three stages, each row evaluated on the same held-out
tasks (seeds from 1_000_000), every episode played by the agent through the official client:

1. **base**: the model as shipped;
2. **format warm-up**: a few supervised steps on scripted conversations of a *different*
   task with the same tool and system prompt: word problems with 2-digit numbers ("A crate
   holds 23 bottles. How many bottles are in 45 crates?"), answered by a ``multiply`` call
   and then the number. The demonstrations are recorded through the endpoint itself (the
   agent's own code against a server whose engine replies with the scripted text), so the
   warm-up trains on exactly the token ids, loss mask and tool format the served path uses;
3. **+ GRPO**: ``train_agent`` (turnrl/serve/train.py) runs the agent G times per task on
   the 3-digit products and trains on the recorded calls. ``--mode async`` trains with
   ``run.mode async`` instead (agents keep playing while the learner trains, groups
   at most ``--max-versions`` behind; turnrl/serve/source.py), in its own directory,
   from the same warm-up, so the two modes compare side by side.

Every stage is kept in ``--out`` (base.json, warm/, warm.json, rl/ checkpoints, after.json):
run the same command again after a kill and it continues where it stopped (an async run that
was killed starts its training stage again).

    python benchmarks/serve_agent.py --threads 1              # SmolLM2
    python benchmarks/serve_agent.py --model tiny --steps 1 --tasks 4 --group-size 2 --groups 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import runpy
import shutil
import sys
import time
from pathlib import Path

from turnrl.config import ServeConfig, load_config
from turnrl.evaluation import EvalResult
from turnrl.metrics import print_table
from turnrl.models import configure_torch, load_model
from turnrl.rollout import ChatFormat
from turnrl.samplers import Completion
from turnrl.serve import Server, load_server
from turnrl.serve.app import RunningServer
from turnrl.serve.train import evaluate_agent, train_agent
from turnrl.stats import format_rate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from warmup import imitation_steps  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
AGENT = runpy.run_path(str(ROOT / "examples" / "openai_agent.py"))
WARM_MARKER = "turnrl-serve-warmup.json"
STORIES = ["A crate holds {a} bottles. How many bottles are in {b} crates?",
           "A room has {a} rows of {b} seats. How many seats are there?",
           "A box holds {a} pencils. How many pencils are in {b} boxes?"]


def warmup_task(seed: int) -> dict:
    """The warm-up's task: a word problem with 2-digit numbers (not the evaluated one)."""
    rng = random.Random(seed)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return {"question": rng.choice(STORIES).format(a=a, b=b), "answer": a * b, "a": a, "b": b}


def call_text(a: int, b: int) -> str:
    return ("<tool_call>\n" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
            + "\n</tool_call>")


class ScriptedEngine:
    """Replies with the next scripted texts (one per generate call), ending the turn as the
    model does; the demonstrations' stand-in for the model."""

    def __init__(self, chat: ChatFormat):
        self.chat, self.version, self.replies = chat, 0, []

    def generate(self, prompts, params):
        ids = self.chat.encode(self.replies.pop(0)) + [self.chat.end_of_turn]
        return [Completion(list(ids), [0.0] * len(ids), "stop") for _ in prompts]


def record_demonstrations(model, tokenizer, name: str, count: int
                          ) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of ``count`` correct warm-up episodes, recorded by the server
    while the example agent plays them (one at a time: the script is one queue)."""
    chat = ChatFormat(tokenizer)
    engine = ScriptedEngine(chat)
    server = Server(model, chat, engine, name=name, max_context=None, cfg=ServeConfig(port=0))
    rows, spans = [], []
    with RunningServer(server) as running:
        from openai import AsyncOpenAI
        for k in range(count):
            task = warmup_task(10_000 + k)
            engine.replies = [call_text(task["a"], task["b"]), str(task["answer"])]
            episode = f"demo-{k}"

            async def play(task: dict, episode: str) -> float:
                async with AsyncOpenAI(base_url=running.base_url, api_key="x", max_retries=0,
                                       default_headers={"X-TurnRL-Episode": episode}) as client:
                    # room for the scripted text in any tokenizer (the tiny one is per character)
                    return await AGENT["rollout"](client, task, model=name, max_tokens=256)
            if asyncio.run(play(task, episode)) != 1.0:
                raise RuntimeError(f"the scripted demonstration {k} did not solve its task")
            (segment,) = server.recorder.episodes.pop(episode).segments
            spans.append(segment.spans)
            rows.append((segment.token_ids, segment.loss_mask))
    longest = max(end - start for k in range(len(rows)) for start, end in spans[k])
    print(f"demonstrations: longest reply {longest} tokens", flush=True)
    return rows


def warm_up(model, rows, *, steps: int, lr: float, pad: int, batch: int = 8,
            seed: int = 0) -> list[float]:
    """Supervised steps on the recorded demonstrations; returns the losses."""
    return imitation_steps(model, rows, pad, steps=steps, lr=lr, batch=batch, seed=seed)


def evaluate(cfg_args: list[str], tasks: list[dict], path: Path) -> EvalResult:
    """The agent on ``tasks`` against a fresh server of ``cfg_args``; cached in ``path``."""
    if path.exists():
        return EvalResult(**json.loads(path.read_text()))
    server = load_server(load_config(None, [*cfg_args, "--serve.port", "0"]))
    started = time.perf_counter()
    with RunningServer(server) as running:
        result = asyncio.run(evaluate_agent(AGENT["rollout"], tasks, running.base_url))
    fields = {k: getattr(result, k) for k in ("episodes", "successes", "mean_reward",
                                              "mean_turns", "failed")}
    path.write_text(json.dumps(fields))
    print(f"{path.stem}: {format_rate(result.successes, result.episodes)} "
          f"({time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps")
    parser.add_argument("--tasks", type=int, default=64, help="held-out tasks per row")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4, help="tasks per GRPO step")
    parser.add_argument("--lr", type=float, default=4e-5, help="GRPO learning rate")
    parser.add_argument("--warmup-steps", type=int, default=6)
    parser.add_argument("--warmup-demos", type=int, default=64)
    parser.add_argument("--warmup-lr", type=float, default=2e-5)
    parser.add_argument("--out", default="runs/serve-agent")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--mode", choices=["sync", "async"], default="sync",
                        help="train_agent mode (run.mode)")
    parser.add_argument("--max-versions", type=int, default=1,
                        help="async: staleness bound (staleness.max_versions)")
    parser.add_argument("--in-flight", type=int, default=0,
                        help="async: task groups played at once (0: 2 x --groups)")
    args = parser.parse_args()
    started = time.perf_counter()
    configure_torch(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = ["--run.threads", str(args.threads)]
    print(f"# machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"{args.threads} torch threads", flush=True)
    held_out = [AGENT["task"](1_000_000 + i) for i in range(args.tasks)]
    base = evaluate(["--model.name", args.model, *threads], held_out, out / "base.json")

    warm_dir = out / "warm"
    if not (warm_dir / WARM_MARKER).exists():
        began = time.perf_counter()
        model, tokenizer = load_model(args.model)
        rows = record_demonstrations(model, tokenizer, args.model, args.warmup_demos)
        losses = warm_up(model, rows, steps=args.warmup_steps, lr=args.warmup_lr,
                         pad=tokenizer.pad_token_id)
        model.save_pretrained(warm_dir)
        tokenizer.save_pretrained(warm_dir)
        info = {"losses": losses, "seconds": time.perf_counter() - began}
        (warm_dir / WARM_MARKER).write_text(json.dumps(info))
        print(f"format warm-up: {args.warmup_steps} steps on {len(rows)} recorded "
              f"demonstrations, loss {losses[0]:.2f} -> {losses[-1]:.2f}, "
              f"{info['seconds']:.0f} s", flush=True)
        del model
    warm = evaluate(["--model.name", str(warm_dir), *threads], held_out, out / "warm.json")

    rl_dir = out / ("rl" if args.mode == "sync" else "rl-async")
    final = rl_dir / "checkpoints" / f"step-{args.steps:06d}"
    if not final.exists():
        mode = ["--run.mode", args.mode]
        if args.mode == "async":  # no resume: a killed async run trains again from the warm-up
            shutil.rmtree(rl_dir, ignore_errors=True)
            mode += ["--staleness.max_versions", str(args.max_versions),
                     "--serve.groups_in_flight", str(args.in_flight)]
        cfg = load_config(None, [*mode, 
            "--model.name", str(warm_dir), *threads, "--run.out_dir", str(rl_dir),
            "--run.steps", str(args.steps), "--rollout.group_size", str(args.group_size),
            "--rollout.groups_per_step", str(args.groups), "--optim.lr", str(args.lr),
            "--serve.port", "0", "--run.checkpoint_every", "1", "--run.keep_checkpoints", "2",
            "--run.progress", "false"])
        began = time.perf_counter()
        result = train_agent(AGENT["rollout"], [AGENT["task"](i) for i in range(10_000)], cfg,
                             resume=args.mode == "sync" and (rl_dir / "config.yaml").exists())
        print(f"GRPO ({args.mode}): {len(result.rewards)} steps this session, training reward "
              f"{[round(r, 2) for r in result.rewards]}, {time.perf_counter() - began:.0f} s",
              flush=True)
        if args.mode == "async":
            print(f"async: trained groups' staleness {result.staleness}, "
                  f"{len(result.dropped)} groups dropped", flush=True)
    after_file = out / ("after.json" if args.mode == "sync" else "after-async.json")
    after = evaluate(["--model.name", str(warm_dir), *threads, "--serve.checkpoint", str(final)],
                     held_out, after_file)

    rows = [[name, format_rate(r.successes, r.episodes)] for name, r in
            (("SmolLM2 as shipped" if "smollm2" in args.model else args.model, base),
             ("+ format warm-up (word problems)", warm),
             (f"+ GRPO ({args.mode}), {args.steps} steps", after))]
    print_table(f"examples/openai_agent.py: {args.tasks} held-out 3-digit products",
                ["policy", "success [95% CI]"], rows)
    print(f"whole run (this session) {(time.perf_counter() - started) / 60:.1f} min, load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
