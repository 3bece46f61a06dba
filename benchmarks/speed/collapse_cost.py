"""What the template-collapse monitor costs per step, relative to the policy update.

One fixed step's episodes (``--groups`` groups of 8 sharing a prompt of ``--prompt`` tokens;
each episode two policy turns of ``--policy`` tokens with an observation of ``--policy``
tokens between them, as a multi-turn task writes them), so the monitor finds more distinct
contexts than its cap. Alternating, ``--repeats`` times: the monitor at its defaults
(``trainer/collapse.py``: ``run.collapse_prompts`` 8 x ``run.collapse_replies`` 8, forward
passes only) and the update on the same episodes (``trainer/step.py::policy_update``, one
epoch). Wall and process CPU seconds, medians; the step's other stages (collection above
all) make the monitor's share of a whole step smaller still.

Usage: ``python benchmarks/speed/collapse_cost.py [--model tiny|smollm2-135m-instruct]
[--groups 4] [--prompt 128] [--policy 24] [--repeats 5] [--prompts 8] [--replies 8]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from turnrl.config import load_config
from turnrl.models import load_model
from turnrl.trainer.collapse import CollapseMonitor
from turnrl.trainer.run import update_settings
from turnrl.trainer.step import make_optimizer, policy_update
from turnrl.types import Batch, Episode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402


def step_episodes(vocab: int, groups: int, prompt: int, policy: int) -> list[Episode]:
    """Random tokens: per group a shared prompt, then per episode reply, observation, reply."""
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    out = []
    for group in range(groups):
        shared = tokens(prompt)
        for _ in range(8):
            ids = shared + tokens(policy) + tokens(policy) + tokens(policy)
            mask = [0] * prompt + [1] * policy + [0] * policy + [1] * policy
            out.append(Episode("bench", group, group, token_ids=ids, loss_mask=mask,
                               logprobs=[-5.0 * m for m in mask]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--policy", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--replies", type=int, default=8)
    args = parser.parse_args(argv)
    cfg = load_config(None, ["--model.name", args.model, "--optim.micro_batch_size", "8"])
    model, tokenizer = load_model(args.model)
    settings = update_settings(cfg, model)
    optimizer = make_optimizer(model, cfg.optim)
    episodes = step_episodes(len(tokenizer), args.groups, args.prompt, args.policy)
    batch = Batch.from_episodes(episodes, torch.randn(len(episodes)), tokenizer.pad_token_id)
    monitor = CollapseMonitor(1, args.prompts, args.replies)
    load = harness.load_average()
    rounds = harness.alternate(  # one warm-up of each, then alternating rounds
        {"collapse": lambda: monitor.metrics(model, episodes, 1.0, tokenizer.pad_token_id),
         "update": lambda: policy_update(model, optimizer, batch, settings)}, args.repeats)
    walls, cpus = rounds.medians(), rounds.medians("cpu")
    shown = rounds.results["collapse"][-1]
    print(f"{args.model}: {len(episodes)} episodes x ({args.prompt} prompt + 3 x {args.policy})"
          f" tokens; monitor {shown['collapse/replies']:.0f} replies x "
          f"{shown['collapse/prompts']:.0f} contexts; {torch.get_num_threads()} threads, "
          f"medians of {args.repeats}")
    for name in walls:
        print(f"  {name:8s} wall {walls[name]:7.3f} s   cpu {cpus[name]:7.3f} s")
    for kind in ("wall", "cpu"):
        print(harness.interval_line(f"collapse / update {kind}",
                                    getattr(rounds, kind)["collapse"],
                                    getattr(rounds, kind)["update"]))
    print(harness.machine(load))
    print(harness.ratio_line("collapse / update cpu", cpus["collapse"] / cpus["update"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
