"""Why the turn-level critic does not engage online: its inputs drift with the policy.

Collects two real training batches of key-corridor (horizon 16, the sweep's turn_gae
settings, tuning seed 100: the policy takes one lr 1e-2 step between them), then fits a fresh
turn-level V head (lambda-returns with lambda 1 = discounted returns) on batch 1 with features
from the *starting* model and reports its relative fit error (MSE / variance of the returns;
1 = no better than the mean): in-sample on batch 1 after each call of 32 updates, and on the
new episodes of batch 2 read through the same frozen features. Compare with the online
``credit/critic_fit_error`` of a sweep run (``--run DIR``), where each batch's features come
from the policy that has just moved.

Usage::

    python benchmarks/learning/credit_critic_drift.py [--run /tmp/credit/runs/h16-turn_gae-s0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import credit_assignment as bench  # noqa: E402


def collect(out: str, steps: int = 2) -> list:
    """The training batches of a short real run (the estimator's input, step by step)."""
    from turnrl.algorithms import estimators
    from turnrl.config import load_config
    from turnrl.trainer import train

    batches, original = [], estimators._TurnCritic.advantages

    def spy(self, episodes, model, pad_id):
        batches.append(list(episodes))
        return original(self, episodes, model, pad_id)

    s = bench.Settings(steps=steps, eval_episodes=0)
    args = bench.run_config_args(16, "turn_gae", bench.METHOD_SETTINGS["turn_gae"], 100, s, out)
    args[args.index("--eval.episodes") + 1] = "0"
    estimators._TurnCritic.advantages = spy
    try:
        train(load_config(None, args))
    finally:
        estimators._TurnCritic.advantages = original
    return batches


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", help="a sweep run dir whose metrics.jsonl to summarise")
    p.add_argument("--out", default="runs/credit_critic_drift")
    args = p.parse_args()
    torch.set_num_threads(1)
    from turnrl.algorithms.critic import extract_turn_features
    from turnrl.algorithms.estimators import EstimatorSettings, critic_fit_error, make_estimator
    from turnrl.config import AlgoConfig, CriticConfig
    from turnrl.models import tiny_model

    first, second = collect(args.out)[:2]
    model, tok = tiny_model(0)  # the starting weights: fixed features
    critic = CriticConfig(gae_lambda=1.0, lr=1e-2, updates=32)
    estimator = make_estimator(EstimatorSettings(AlgoConfig(advantage="turn_gae"), critic,
                                                 model.config.hidden_size))
    errors = []
    for _ in range(8):
        estimator.advantages(first, model, tok.pad_token_id)
        errors.append(estimator.metrics()["credit/critic_fit_error"])
    held_out = critic_fit_error(estimator.critic, second,
                                extract_turn_features(model, second, tok.pad_token_id, "cpu"),
                                critic.gamma)
    print("fixed features, in-sample fit error per call of 32 updates:",
          ", ".join(f"{e:.2f}" for e in errors))
    print(f"fixed features, new episodes (batch 2): fit error {held_out:.2f}")
    if args.run:
        from turnrl.metrics import read_metrics

        online = [r["credit/critic_fit_error"] for r in read_metrics(Path(args.run)
                                                                     / "metrics.jsonl")]
        print(f"online ({args.run}): fit error before each update, median "
              f"{statistics.median(online):.2f}, min {min(online):.2f} over {len(online)} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
