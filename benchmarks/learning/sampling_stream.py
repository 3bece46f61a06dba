"""Does async training learn less, or did it draw other random numbers? One process, no Ray.

The same learner update (``policy_update``; decoupled PPO for the worker's loop, as in async
mode) is fed each step by one of two data sources, both playing the sync trainer's seeds
with the learner's current weights:

- ``sync``: the sync trainer's lock-step turn loop on the learner's own engine;
- ``worker``: the async rollout worker's continuous loop (``TurnLoop``) on a
  separate model copy that is sent the learner's state dict before every step, as a Ray
  worker is (tied weights shipped once).

``--sampler-seed`` seeds the sampling generator of whichever engine samples. With the same
seed both sources sample the same first batch; the question is how far the learning curves
then differ, against how far two seeds of one source differ. Measured on 2 cores
(SmolLM2-135M, guess-number, 8 steps; see docs/benchmarks.md):

    python benchmarks/learning/sampling_stream.py --source sync --sampler-seed 17
    python benchmarks/learning/sampling_stream.py --source worker --sampler-seed 17
    python benchmarks/learning/sampling_stream.py --source worker --sampler-seed 0

Each prints one JSON line per step (training success, entropy, ESS) and the held-out success.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from turnrl.config import load_config
from turnrl.distributed.worker_engines import with_tied_weights, without_tied_weights
from turnrl.models import configure_torch
from turnrl.policy import load_policy, training_seeds
from turnrl.rollout import run_sync
from turnrl.rollout.loop import TurnLoop, run_episodes
from turnrl.trainer.evaluation import held_out_eval
from turnrl.trainer.rl_step import StageTimer, rl_step
from turnrl.trainer.run import build_learner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=["sync", "worker"], required=True)
    parser.add_argument("--sampler-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="run.seed: the episodes' seeds")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    configure_torch(args.threads)
    torch.manual_seed(args.seed)
    cfg = load_config(None, ["--model.name", args.model, "--env.name", "guess-number",
                             "--rollout.group_size", "8", "--rollout.groups_per_step", "4",
                             "--rollout.max_new_tokens", "8", "--optim.lr", "4e-5",
                             "--run.seed", str(args.seed), "--eval.episodes", "64"])
    learner = load_policy(cfg)
    model, chat, params, make = learner.model, learner.chat, learner.params, learner.make_env
    # async mode's objective for the worker's data
    update = build_learner(cfg, learner, decoupled=args.source == "worker")
    worker = load_policy(cfg) if args.source == "worker" else learner
    worker.engine.generator.manual_seed(args.sampler_seed)
    size = cfg.rollout.group_size

    for step in range(args.steps):
        started = time.perf_counter()
        pairs = training_seeds(cfg, step)
        if args.source == "sync":
            episodes = run_sync(run_episodes(make, pairs, learner.engine, chat, params,
                                             env_name=cfg.env.name,
                                             max_turns=cfg.rollout.max_turns,
                                             max_context=learner.max_context))
        else:
            state = without_tied_weights({k: v.detach().clone()
                                          for k, v in model.state_dict().items()})
            worker.model.load_state_dict(with_tied_weights(state))
            worker.engine.load(None, step)
            loop = TurnLoop(make, worker.engine, chat, params, group_size=size,
                                     env_name=cfg.env.name, max_turns=cfg.rollout.max_turns,
                                     max_context=learner.max_context, partial_rollouts=False)
            for assignment, (seed, _) in enumerate(pairs[::size]):
                loop.submit(assignment, seed)
            run_sync(loop.run(until_drained=True))
            groups = sorted(loop.take_groups(), key=lambda g: g.assignment)
            episodes = [ep for group in groups for ep in group.episodes]
        _, metrics = rl_step(update, episodes, StageTimer())
        learner.engine.load(None, learner.engine.version + 1)
        print(json.dumps({
            "source": args.source, "sampler_seed": args.sampler_seed, "step": step + 1,
            "success": sum(ep.success for ep in episodes) / len(episodes),
            "entropy": round(metrics["entropy"], 3),
            "ess": round(metrics.get("offpolicy/ess", 1.0), 4),
            "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    after, _ = held_out_eval(cfg, learner)
    print(json.dumps({"source": args.source, "sampler_seed": args.sampler_seed,
                      "held_out_success": after.success_rate,
                      "episodes": after.episodes}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
