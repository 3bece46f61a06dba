"""Do learner ranks update the default job as one process does, step after step? (issue 52)

The default job learned less at world size 2 than at 1 (docs/learner.md). From step 2 on the
two runs train on other episodes (the update's rounding changes draws), so their weights
cannot be compared. This replays the SAME episodes through both learners at SmolLM2's
shapes, with the default job's settings (micro-batches of 8, the shared-prompt pass at world
size 1, switched off under FSDP, tied embeddings):

1. one process plays ``--steps`` steps of the default job (``run.threads 1``), updating
   between steps (on-policy, as ``turnrl train`` does), and keeps its weights after each step;
2. ``--ranks`` learner ranks (rank 0 here, the others the real ``python -m
   turnrl.trainer.ranks``) update on the same episodes, gather the weights after each step
   (as publishing to rank 0's sampler does), and with ``--save-after K`` write a sharded
   checkpoint after step K (as ``run.checkpoint_every`` does), then go on.

Per step it prints both losses and gradient norms, the largest weight difference, and the
difference's norm over the norm of that step's own change (1: as different as a whole step).

    python benchmarks/learning/ranks_replay.py --steps 4 --ranks 2 --strategy fsdp --save-after 2

Measured on 2 cores (docs/learner.md, "Held-out success at world size 2"): fsdp, a checkpoint
after step 2, ends step 4 at 3.4e-4 of the one-process step apart from it (largest weight
difference 6.5e-6, lr 4e-5).
``--model tiny`` runs in a few minutes (the replay, not the finding).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

from turnrl.config import Config, load_config
from turnrl.trainer.rl_step import StageTimer, rl_step
from turnrl.trainer.run import learner_for, seed_run, start_run

SHOWN = ("loss/policy", "grad_norm")


def job(work: Path, model: str) -> Config:
    """The default job on ``model``, one thread, no held-out evaluation."""
    return load_config(None, ["--model.name", model, "--run.threads", "1",
                              "--run.progress", "false", "--eval.episodes", "0",
                              "--run.out_dir", str(work / "play")])


def published(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from turnrl.learner.weights import published_state

    return {k: v.detach().clone() for k, v in published_state(model).items()}


def play(work: Path, model: str, steps: int) -> list[dict]:
    """One process: play and update ``steps`` steps; the episodes and per-step weights go to
    ``work``; returns the per-step metrics."""
    from turnrl.policy import publish
    from turnrl.trainer.local import LocalSource

    run = start_run(job(work, model), False)
    source = LocalSource()
    source.open(run)
    batches, rows = [], []
    for step in range(steps):
        episodes = source.collect(step)
        batches.append(episodes)
        metrics = rl_step(run.learner, episodes, StageTimer())[1]
        rows.append({k: metrics[k] for k in SHOWN})
        torch.save(published(run.learner.model), work / f"one-{step + 1}.pt")
        publish(run.policy.engine, run.learner.model, step + 1)
    source.close()
    (work / "episodes.pkl").write_bytes(pickle.dumps(batches))
    return rows


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
               before: dict[str, torch.Tensor] | None) -> dict[str, float]:
    """The largest |a - b| (and where), and ||a - b|| / ||a - before||."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    worst = {k: float((a[k] - b[k]).abs().max()) for k in a}
    name = max(worst, key=worst.get)
    out = {"max_abs": worst[name], "where": name}
    if before is not None:
        apart = sum(float((a[k] - b[k]).norm()) ** 2 for k in a) ** 0.5
        moved = sum(float((a[k] - before[k]).norm()) ** 2 for k in a) ** 0.5
        out["of_step"] = apart / moved
    return out


def drive(work: Path, name: str, strategy: str, save_after: int) -> None:
    """Rank 0: start the other ranks' learners, update on the played episodes, compare."""
    from turnrl.learner.checkpoints import save_sharded
    from turnrl.learner.world import join, leave, store_client
    from turnrl.policy import policy_model

    size = int(os.environ["WORLD_SIZE"])
    cfg = job(work, name)
    cfg = replace(cfg, learner=replace(cfg.learner, world_size=size, strategy=strategy))
    port = int(os.environ["MASTER_PORT"])
    world = join(0, size, strategy, "gloo", torch.device("cpu"), cfg.learner.timeout_s,
                 "127.0.0.1", port, store_client("127.0.0.1", port, size, cfg.learner.timeout_s))
    world.command("start", (cfg, None, False))
    seed_run(cfg)
    model, tokenizer = policy_model(cfg, torch.device("cpu"))
    learner = learner_for(cfg, model, tokenizer, world=world)
    rows, before = [], None
    for step, episodes in enumerate(pickle.loads((work / "episodes.pkl").read_bytes()), 1):
        metrics = rl_step(learner, episodes, StageTimer())[1]
        one = torch.load(work / f"one-{step}.pt")
        rows.append({**{k: metrics[k] for k in SHOWN},
                     **difference(one, published(model), before)})
        before = one
        if step == save_after:
            world.command("save", work / "sharded")
            save_sharded(work / "sharded", learner.model, learner.optimizer)
    world.command("stop")
    leave(together=True)
    (work / "ranks.json").write_text(json.dumps(rows))


def ranks(work: Path, model: str, size: int, strategy: str, save_after: int) -> list[dict]:
    """``drive`` as rank 0 in a child process, ranks 1.. as ``turnrl train`` starts them."""
    from turnrl.learner.world import rendezvous_store
    from turnrl.trainer.ranks import LEARNER_ENV

    learner = replace(job(work, model).learner, world_size=size, strategy=strategy, backend="gloo")
    store = rendezvous_store(size, learner.timeout_s)  # served here, bound before any rank starts
    env = {**os.environ, "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(store.port), LEARNER_ENV: json.dumps(asdict(learner))}
    procs = [subprocess.Popen([sys.executable, __file__, "--drive", str(work), "--model", model, "--strategy",
                               strategy, "--save-after", str(save_after)],
                              env={**env, "RANK": "0"})]
    procs += [subprocess.Popen([sys.executable, "-m", "turnrl.trainer.ranks"],
                               env={**env, "RANK": str(rank)}) for rank in range(1, size)]
    codes = [p.wait(timeout=2 * learner.timeout_s + 3600) for p in procs]  # a hung rank ends
    if codes != [0] * size:
        raise SystemExit(f"ranks ended with {codes}")
    return json.loads((work / "ranks.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--save-after", type=int, default=0,
                        help="write a sharded checkpoint after this step (0: none)")
    parser.add_argument("--drive", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:  # rank 0 of ``ranks``
        drive(Path(args.drive), args.model, args.strategy, args.save_after)
        sys.stdout.flush()
        os._exit(0)  # as turnrl.trainer.ranks does: no interpreter finalisation after gloo
    with tempfile.TemporaryDirectory(prefix="ranks-replay-") as tmp:
        one = play(Path(tmp), args.model, args.steps)
        many = ranks(Path(tmp), args.model, args.ranks, args.strategy, args.save_after)
    for step, (a, b) in enumerate(zip(one, many, strict=True), 1):
        print(json.dumps({"step": step, **{f"one/{k}": v for k, v in a.items()},
                          **{f"ranks/{k}": v for k, v in b.items()}}))


if __name__ == "__main__":
    main()
