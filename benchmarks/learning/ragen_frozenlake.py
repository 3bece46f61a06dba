"""FrozenLake as RAGEN runs it: a base model's held-out success, beside RAGEN's published figure.

    python benchmarks/learning/ragen_frozenlake.py --episodes 256 --out /tmp/ragen_fl

plays ``--episodes`` held-out seeds (one episode each; RAGEN validates on 256) with ``turnrl
eval`` on ``gymnasium --env.options.protocol ragen`` (a new slippery 4x4 map per seed, five
turns, up to five moves a turn and ten in all: turnrl/envs/adapters/frozen_lake.py says where
in RAGEN each value is set), at RAGEN's validation temperature 0.5 and 100 new tokens a turn,
and today's fixed 4x4 non-slippery map beside it (``--also-plain``). It prints success with a
95% Wilson interval per row, and RAGEN's figure on its own row, labelled as quoted: it is
their Qwen2.5-0.5B-Instruct trained with their RL, not a run of this script, so the rows
compare protocols, not methods.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RAGEN_QUOTED = ("RAGEN (Wang et al. 2025, arXiv:2504.20073), Qwen2.5-0.5B-Instruct after "
                "their RL, as quoted in issue 55; not run here", "18-21%")
SETTINGS = {
    "ragen": ["--env.name", "gymnasium", "--env.options.protocol", "ragen"],
    "plain 4x4": ["--env.name", "gymnasium", "--env.options.game", "FrozenLake-v1",
                  "--env.options.is_slippery", "false", "--rollout.max_turns", "8"],
}


def evaluate(model: str, setting: str, episodes: int, tokens: int, out: Path) -> dict:
    """One ``turnrl eval`` of ``model`` on ``setting`` at temperature 0.5 and ``tokens`` new
    tokens a turn; its JSON report and wall seconds."""
    path = out / f"{setting.replace(' ', '_')}.json"
    command = [sys.executable, "-m", "turnrl", "eval", "--model.name", model,
               "--eval.episodes", str(episodes), *SETTINGS[setting], "--eval.temperature",
               "0.5", "--rollout.max_new_tokens", str(tokens), "--out", str(path)]
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    return {"report": json.loads(path.read_text()), "wall_s": time.perf_counter() - start,
            "command": " ".join(command[1:])}


def row(setting: str, model: str, result: dict) -> str:
    summary = result["report"]["result"]
    first = summary["pass_at_k"]["1"]  # one episode per seed: a Wilson interval
    n = summary["episodes"]
    return (f"{setting:<10} {model:<24} {first['value']:6.1%} [{first['lo']:.1%}, "
            f"{first['hi']:.1%}] ({round(first['value'] * n)}/{n})  "
            f"{result['wall_s'] / 60:.1f} min")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=100, help="new tokens a turn (RAGEN: 100)")
    parser.add_argument("--also-plain", action="store_true")
    parser.add_argument("--out", default="/tmp/ragen_frozenlake")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = ["ragen"] + (["plain 4x4"] if args.also_plain else [])
    results = {s: evaluate(args.model, s, args.episodes, args.tokens, out) for s in settings}
    print(f"\nbase model, held-out, one episode per seed, temperature 0.5 (load: "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    for setting, result in results.items():
        print(row(setting, args.model, result))
        print(f"  command: {result['command']}")
    print(f"{'ragen':<10} {RAGEN_QUOTED[1]:>8}  <- {RAGEN_QUOTED[0]}")
    (out / "summary.json").write_text(json.dumps(
        {s: {**r["report"], "wall_s": r["wall_s"], "command": r["command"]}
         for s, r in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
