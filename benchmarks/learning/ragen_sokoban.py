"""Sokoban (or FrozenLake) as RAGEN runs it: SmolLM2 base, after RL alone and after a TurnRL
cold start, held-out, beside RAGEN's published figure.

    python benchmarks/learning/ragen_sokoban.py --methods rl,warmup --out /tmp/ragen_sokoban
    python benchmarks/learning/ragen_sokoban.py --env frozenlake --methods rl,warmup
    python benchmarks/learning/ragen_sokoban.py --quick --out /tmp/ragen_sokoban_quick

Every run is one ``turnrl train`` command on ``sokoban --env.options.protocol ragen`` (a new
carved 6x6 room with one box per seed, five turns of up to five moves, ten moves in all:
turnrl/envs/sokoban.py says where in RAGEN each value is set), built and run by
``cold_start.py`` (its ``train_command`` and ``run_once``), with RAGEN's validation settings
added: temperature 0.5 and 100 new tokens a turn. ``--env frozenlake`` plays ``gymnasium
--env.options.protocol ragen`` instead (a new slippery 4x4 map per seed with random start and
goal, the same turns and moves: turnrl/envs/adapters/frozen_lake.py); its reference player is
value iteration on the drawn map, two moves a turn. Methods:

- ``rl``: GRPO from the base model, the setting RAGEN reports (no expert anywhere); its
  ``eval_before`` is the base model's held-out success;
- ``warmup``: a TurnRL cold start RAGEN does not use: SFT on the breadth-first reference
  player's demonstrations (``--sft.env_demos``, seeds 0..M-1), then the same RL;
- ``guided``: the other TurnRL cold start, guided RL (``--explore.guidance demo``).

Held-out rooms are ``eval.seed_offset`` onwards, disjoint from training and demonstration
seeds. The table is ``cold_start.py``'s (base, RL start, after RL with a 95% Wilson interval
for one seed, t over seeds for several, wall and CPU minutes) with RAGEN's figure on its own
row, labelled as quoted: their Qwen2.5-0.5B-Instruct after their RL, not a run of this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cold_start  # noqa: E402  (the sibling script: the run and table machinery)

TASK = cold_start.ColdTask(("--env.name", "sokoban", "--env.options.protocol", "ragen"), 5, 100,
                           "RAGEN's SimpleSokoban: carved 6x6, one box, 5 turns x 5 moves, "
                           "10 moves in all")
FROZEN_LAKE = cold_start.ColdTask(
    ("--env.name", "gymnasium", "--env.options.protocol", "ragen"), 5, 100,
    "RAGEN's FrozenLake: slippery 4x4 drawn per seed, random start and goal, 5 turns x 5 moves, "
    "10 moves in all")
RAGEN_EVAL = ("--optim.micro_batch_size", "2", "--eval.temperature", "0.5")
"""RAGEN's validation temperature; two sequences a backward pass, as the base model's
100-token replies over five turns made the default eight outgrow a 23 GB machine"""
METHODS = ("rl", "warmup", "guided")
LABELS = {"rl": "RL alone (as RAGEN)", "warmup": "warm-up on the solver's demos, then RL "
          "(TurnRL cold start; RAGEN uses no expert)", "guided": "guided RL from the solver "
          "(TurnRL cold start; RAGEN uses no expert)"}
RAGEN_QUOTED = ("RAGEN (Wang et al. 2025, arXiv:2504.20073; RAGEN.pdf at 5eb79b8, Table 2 at 16 "
                "responses a prompt, Table 4 StarPO-S), Qwen2.5-0.5B-Instruct after their RL; "
                "quoted, not run here", "20.3-21.5%")
FROZEN_LAKE_QUOTED = ("RAGEN (Wang et al. 2025, arXiv:2504.20073; its tables give 12.5-21.5%, "
                      "19.53% at 16 responses a prompt), Qwen2.5-0.5B-Instruct after their RL; "
                      "quoted, not run here", "18-21%")
ENVS = {"sokoban": (TASK, RAGEN_QUOTED), "frozenlake": (FROZEN_LAKE, FROZEN_LAKE_QUOTED)}
BUDGET = cold_start.Budget(steps=4, group_size=8, groups_per_step=2, eval_episodes=32,
                           sft_steps=16, sft_demos=64, threads=1)
"""What a 2-core machine shared with other jobs allows (docs/ragen.md); RAGEN trains 200 steps
of 8 groups of 16 and validates on 256 rooms"""
QUICK = dataclasses.replace(cold_start.QUICK, eval_episodes=2, sft_demos=8)
"""8 demonstration seeds: the FrozenLake player fails its first four (slippery ice)"""


def command(task: cold_start.ColdTask, method: str, seed: int, budget: cold_start.Budget,
            folder: Path) -> list[str]:
    """The ``turnrl train`` command of one run: cold_start's, with RAGEN's validation."""
    return [*cold_start.train_command(task, method, seed, budget, folder), *RAGEN_EVAL]


class RandomMover:
    """Uniformly random moves, ``per_turn`` a turn, chained as RAGEN's replies are: the level a
    model must beat before it has learnt anything."""

    def __init__(self, per_turn: int, rng: random.Random) -> None:
        self.per_turn, self.rng = per_turn, rng

    def reset(self, first_observation: str) -> None:
        pass

    def act(self, observation: str) -> str:
        return " || ".join(self.rng.choice(("up", "down", "left", "right"))
                           for _ in range(self.per_turn))


def floors(env: str, episodes: int, seeds: int = 256) -> dict[str, float]:
    """Held-out success (seeds ``eval.seed_offset`` onwards, ``seeds`` of them) of a random
    mover at 5 moves a turn over ``episodes`` episodes, and of the env's reference player once
    a seed: the protocol's floor and a planner's level, no model involved."""
    from turnrl.config import Config
    from turnrl.envs import make_env
    from turnrl.envs.reference import play, reference_player
    from turnrl.rollout import run_sync

    task = ENVS[env][0]
    name, options = task.env[1], dict(zip(task.env[2::2], task.env[3::2], strict=True))
    options = {k.removeprefix("--env.options."): v for k, v in options.items()}
    first, rng = Config().eval.seed_offset, random.Random(0)

    def rate(player_for, count: int) -> float:
        wins = 0
        for i in range(count):
            game = make_env(name, **options)
            wins += run_sync(play(game, player_for(game), first + i % seeds))[1]
        return wins / count

    return {"random": rate(lambda game: RandomMover(5, rng), episodes),
            "reference": rate(lambda game: reference_player(game, name), seeds)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", choices=sorted(ENVS), default="sokoban")
    parser.add_argument("--methods", default="rl,warmup", help=f"from: {', '.join(METHODS)}")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--eval-episodes", type=int)
    parser.add_argument("--tokens", type=int, help="new tokens a turn (RAGEN: 100)")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--out", help="where the runs go (default runs/ragen_ENV)")
    parser.add_argument("--quick", action="store_true", help="tiny model: the wiring only")
    parser.add_argument("--floors", type=int, metavar="EPISODES",
                        help="only print the random mover's and the reference player's "
                             "held-out success (no model)")
    args = parser.parse_args(argv)
    if args.floors is not None and args.floors < 1:
        parser.error("--floors takes a number of episodes, at least 1")
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        parser.error(f"unknown method '{unknown[0]}'; choose from: {', '.join(METHODS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.floors is not None:
        rates = floors(args.env, args.floors)
        print(f"{args.env}, RAGEN's protocol, held-out seeds from 1,000,000: random mover (5 "
              f"moves a turn, {args.floors} episodes) {rates['random']:.1%}; reference player "
              f"(256 seeds) {rates['reference']:.1%}")
        return 0
    budget = QUICK if args.quick else BUDGET
    overrides = {"steps": args.steps, "eval_episodes": args.eval_episodes,
                 "threads": args.threads}
    budget = dataclasses.replace(budget, **{k: v for k, v in overrides.items() if v is not None})
    task, quoted = ENVS[args.env]
    task = dataclasses.replace(task, max_new_tokens=args.tokens or (3 if args.quick else 100))
    out, rows, base = Path(args.out or f"runs/ragen_{args.env}"), [], None
    for method in args.methods.split(","):
        runs = [cold_start.run_once(command(task, method, seed, budget, folder), folder)
                    for seed in range(args.seeds) for folder in [out / method / f"seed-{seed}"]]
        base = [r["before"] for r in runs] if method == "rl" else base
        rows.append(cold_start.row(args.env, method, runs, base))
    print(f"\n{args.env}, RAGEN's protocol: {budget.model}, {budget.eval_episodes} held-out maps "
          f"a run at temperature 0.5, {budget.steps} RL steps of "
          f"{budget.group_size * budget.groups_per_step} episodes (load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    cold_start.print_rows(["task", "method", "base", "RL start", "after RL (median)", "seeds",
                           "wall min", "CPU min"], rows)
    for method in args.methods.split(","):
        print(f"  {method}: {LABELS[method]}")
    print(f"ragen  {quoted[1]}  <- {quoted[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
