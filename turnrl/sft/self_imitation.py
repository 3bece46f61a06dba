"""Filtered self-imitation (``sft.self_rounds``): rejection-sampling fine-tuning, or expert
iteration (STaR, Zelikman et al. 2022; RAFT, Dong et al. 2023).

    for each round: the model being fine-tuned (its current weights) plays sft.self_samples
    attempts at each of sft.self_tasks new training seeds at rollout.temperature ->
    keep the successes, drop identical ones -> train the round's steps on them
    (with sft.data / sft.env_demos when given)

Round k (from 0) of R takes steps [k * S // R, (k + 1) * S // R) of the run's S steps
(``run.steps`` for ``turnrl sft``, ``sft.steps`` for the warm-up of ``turnrl train``). Its
seeds are k * T ... (k + 1) * T - 1 for T = ``sft.self_tasks``: new each round, and below
``eval.seed_offset`` (a config check), so no held-out task is ever trained on.

Every attempt is written to ``RUN_DIR/rounds/round-K.jsonl`` before the round's first step,
and the round trains on what that file holds, read back, so a run resumed in the middle of
a round trains on exactly the conversations the uninterrupted run did; a run resumed at a
round's start plays it again from the checkpoint's weights and random streams, which draws
the same attempts. The step and the engine's sampler come from the checkpoint as for any run.

A round in which nothing succeeds has nothing to imitate: the stage stops there with one
line saying so (and why), after a checkpoint of the model as it is, and ``stopped.json``
records the step, so a warm-up knows where RL starts (sft/warmup.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from turnrl import safe_json
from turnrl.checkpoint import rng_state, save_checkpoint
from turnrl.demos.data import DataError, Demonstration
from turnrl.rollout.loop import run_episodes, run_sync
from turnrl.trainer.run import Run
from turnrl.types import Episode, read_episodes, write_episodes

CHUNK = 64
"""Attempts played at once (bounds the batch the engine generates for)."""
STOPPED = "stopped.json"


def round_start(k: int, steps: int, rounds: int) -> int:
    """The first step of round ``k`` (from 0) of ``rounds`` over ``steps`` steps."""
    return k * steps // rounds


def round_of(step: int, steps: int, rounds: int) -> int:
    """The round (from 0) that ``step`` (from 0) belongs to."""
    return next(k for k in range(rounds, -1, -1) if round_start(k, steps, rounds) <= step)


def round_seeds(k: int, tasks: int, samples: int) -> list[tuple[int, int]]:
    """(env seed, group) of every attempt of round ``k``: ``samples`` attempts at each of the
    round's ``tasks`` seeds, k * tasks ... (k + 1) * tasks - 1 (a group per seed)."""
    return [(k * tasks + t, t) for t in range(tasks) for _ in range(samples)]


def succeeded(episode: Episode, min_reward: float) -> bool:
    """An attempt worth imitating: a success, or with ``min_reward`` > 0 a reward of at
    least that; an episode cut short (timeout, error, context) never is."""
    if episode.status != "done":
        return False
    return episode.reward >= min_reward if min_reward > 0 else episode.success


def kept_episodes(attempts: list[Episode], min_reward: float) -> list[Episode]:
    """The successful attempts, each distinct token sequence once, in the order played."""
    seen, kept = set(), []
    for episode in attempts:
        key = (tuple(episode.token_ids), tuple(episode.loss_mask))
        if succeeded(episode, min_reward) and key not in seen:
            seen.add(key)
            kept.append(episode)
    return kept


def check_rounds(rounds: int, steps: int, name: str) -> None:
    """Each round needs a step of its own."""
    if rounds > steps:
        raise DataError(f"sft.self_rounds {rounds} is more than the {steps} steps of {name}, "
                        "which are divided over the rounds: raise the steps or lower the rounds")


@dataclass
class SelfImitation:
    """The rounds of one SFT run; ``train_set(step)`` gives the conversations of ``step``."""

    run: Run
    base: list[Episode]
    """The demonstrations every round trains on too (sft.data, sft.env_demos)."""
    tokenise: object
    """``sft.train.tokenise`` (passed in: the module imports this one)."""
    current: int = -1
    conversations: list[Episode] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """The round's figures, logged with its first step."""
    losses: list[float] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return self.run.cfg.sft.self_rounds

    def round_path(self, k: int) -> Path:
        return self.run.run_dir / "rounds" / f"round-{k + 1:03d}.jsonl"

    def train_set(self, step: int) -> list[Episode] | None:
        """The conversations ``step`` draws from: at a round's first step the round is
        played first; a run resumed mid-round reads the round's attempts back. None: the
        round had no success (the line saying so is printed)."""
        cfg = self.run.cfg
        k = round_of(step, cfg.run.steps, self.rounds)
        if k == self.current:
            return self.conversations
        self.end_round()
        path = self.round_path(k)
        first = step == round_start(k, cfg.run.steps, self.rounds)
        if first:
            path.parent.mkdir(exist_ok=True)
            write_episodes(path, self.play(k))
        elif not path.is_file():
            raise DataError(f"{path}: missing, and the run resumes in the middle of round "
                            f"{k + 1}, which trains on it; start a new run directory")
        attempts = read_episodes(path)
        kept = kept_episodes(attempts, cfg.sft.min_reward)
        successes = sum(succeeded(ep, cfg.sft.min_reward) for ep in attempts)
        head = f"round {k + 1} of {self.rounds}: {successes} of {len(attempts)} attempts " \
               f"succeeded on {cfg.env.name}"
        if not kept:
            print(f"sft: {head}: nothing to train on; stopping the self-imitation rounds here "
                  "(a model that never succeeds has nothing to imitate: add demonstrations "
                  "with sft.data or sft.env_demos, guidance, or start from an easier task)",
                  flush=True)
            return None
        chosen = {id(ep) for ep in kept}
        demos = [Demonstration([], None, f"{path.name}:{i + 1}", [ep])
                 for i, ep in enumerate(attempts) if id(ep) in chosen]
        own, skipped = self.tokenise(self.run.policy.chat, demos, skip_unfit=True,
                                     max_tokens=self.run.policy.max_context)
        for line in skipped:
            print(f"sft: {line}", flush=True)
        self.current, self.conversations = k, self.base + own
        print(f"sft: {head} ({successes / len(attempts):.0%}); training on {len(own)} distinct "
              f"successes" + (f" and {len(self.base)} demonstrations" if self.base else ""),
              flush=True)
        if first:  # logged once, with the round's first step (a resumed run logged them)
            self.metrics = {"self/round": k + 1, "self/attempts": len(attempts),
                            "self/successes": successes,
                            "self/success_rate": successes / len(attempts),
                            "self/conversations": len(self.conversations)}
        return self.conversations

    def after_step(self, metrics: dict[str, float]) -> dict[str, str]:
        """Add the round's figures to the step's ``metrics`` (its first step's only), note
        its loss; return the progress bar's field."""
        metrics.update(self.metrics)
        self.metrics = {}
        self.losses.append(metrics["sft/loss"])
        return {"round": f"{self.current + 1}/{self.rounds}"}

    def play(self, k: int) -> list[Episode]:
        """Round ``k``'s attempts, played by the current weights at rollout.temperature."""
        cfg, policy = self.run.cfg, self.run.policy
        pairs = round_seeds(k, cfg.sft.self_tasks, cfg.sft.self_samples)
        episodes: list[Episode] = []
        for i in range(0, len(pairs), CHUNK):
            episodes += run_sync(run_episodes(
                policy.make_env, pairs[i:i + CHUNK], policy.engine, policy.chat,
                policy.params, env_name=cfg.env.name, max_turns=cfg.rollout.max_turns,
                max_context=policy.max_context, env_timeout_s=cfg.rollout.env_timeout_s))
        return episodes

    def end_round(self) -> None:
        """The round's line: its steps and mean training loss."""
        if self.current >= 0 and self.losses:
            print(f"sft: round {self.current + 1} of {self.rounds}: {len(self.losses)} steps, "
                  f"mean loss {sum(self.losses) / len(self.losses):.4f}", flush=True)
        self.losses = []

    def stop(self, step: int) -> None:
        """Stop at ``step`` (a round with no success): checkpoint the model as it is (unless
        that step has one) and record the step in ``stopped.json``."""
        run = self.run
        if step and not (run.run_dir / "checkpoints" / f"step-{step:06d}").is_dir():
            save_checkpoint(run.run_dir, step, run.learner.model, run.learner.optimizer,
                            rng=rng_state(run.policy.engine.generator),
                            keep=run.cfg.run.keep_checkpoints)
        (run.run_dir / STOPPED).write_text(safe_json.dumps({"step": step}))


def stopped_at(run_dir: str | Path) -> int | None:
    """The step a run's self-imitation rounds stopped at (None: they did not stop early)."""
    path = Path(run_dir) / STOPPED
    return json.loads(path.read_text())["step"] if path.is_file() else None
