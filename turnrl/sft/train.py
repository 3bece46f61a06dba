"""``turnrl sft``: supervised fine-tuning on demonstrations, as a source of the one learner
loop (``trainer/learn.py``), its step the token NLL instead of ``rl_step``.

    read + check the file -> learn(cfg, DemonstrationSource):
      open: tokenise as the turn loop -> split -> held-out loss before
      each step: collect (a seeded batch of conversations) -> update (mean NLL of the
      assistant's tokens -> AdamW step -> held-out loss when due) -> end_step (metrics,
      progress bar, checkpoint)

The run directory, config checks, seeding, checkpoints and ``--resume`` are the RL run's
(``trainer/run.py``'s ``start_run``, ``trainer/bookkeeping.py``'s ``end_step``), so a
checkpoint of an SFT run is laid out as an RL run's and a killed SFT run resumes bit for
bit: each step's conversations are a pure function of (``run.seed``, step) and the update
draws no random numbers.

With ``sft.self_rounds`` the conversations are the model's own successes, played afresh
each round (sft/self_imitation.py), with the demonstrations when there are any.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from turnrl.algorithms.losses import token_logprobs
from turnrl.config import Config, ConfigError
from turnrl.demos.conversation import DemoError, conversation_episode
from turnrl.demos.data import DataError, Demonstration, read_demonstrations
from turnrl.demos.scripted import env_demonstrations
from turnrl.evaluation import EvalResult
from turnrl.metrics import print_table
from turnrl.rollout.chat import ChatFormat
from turnrl.sft.self_imitation import STOPPED, SelfImitation, check_rounds
from turnrl.trainer.bookkeeping import TrainResult
from turnrl.trainer.learn import SourceDefaults, Update, learn
from turnrl.trainer.rl_step import Learner, StageTimer
from turnrl.trainer.run import Run
from turnrl.trainer.step import micro_batches, score_policy_tokens, update_autocast
from turnrl.types import Batch, Episode


@dataclass
class SftResult(TrainResult):
    """An SFT run's result: ``before``/``after`` are the env's evaluations (``sft.eval_env``),
    ``steps`` those trained."""

    train_conversations: int
    held_out_conversations: int
    skipped: int
    loss_before: float | None
    """Held-out mean NLL per assistant token before training (None: nothing held out)."""
    loss_after: float | None
    stopped_at: int | None = None
    """The step a self-imitation round with no success stopped the run at (None: it ran
    all its steps)."""


def assistant_nll(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed negative log-likelihood, count) of the assistant's tokens.

    logits [B, T, V] (position t predicts token t + 1), input_ids [B, T] long, loss_mask
    [B, T] (1 where the assistant wrote token t, padding 0). Token t is scored from
    logits[:, t - 1], so column 0 is never scored. Returns two scalars; the mean NLL is
    sum / count, and a step's sums over micro-batches divided by the step's count is the
    step's mean (every token weighs the same, whatever its conversation's length).
    """
    mask = loss_mask[:, 1:].to(torch.float32)
    logprobs = token_logprobs(logits[:, :-1], input_ids[:, 1:])
    return -(logprobs * mask).sum(), mask.sum()


def policy_nll(model: torch.nn.Module, part: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``assistant_nll`` of a micro-batch, with the LM head run on the assistant's tokens only
    (``score_policy_tokens``, as the RL update does) instead of the full [B, T, vocab] logits
    of every prompt and observation token: SmolLM2, 8 tic-tac-toe demonstrations (8 x 324
    tokens, 56 trained), forward and backward 13.3 -> 10.3 s (median of 3, 2 cores, load 2.3)."""
    logprobs, _ = score_policy_tokens(model, part, 1.0)
    mask = part.loss_mask[:, 1:].to(torch.float32)
    return -(logprobs * mask).sum(), mask.sum()


def tokenise(chat: ChatFormat, demos: list[Demonstration], *, skip_unfit: bool,
             max_tokens: int | None, min_reward: float = 0.0
             ) -> tuple[list[Episode], list[str]]:
    """Each demonstration as the turn loop's episode: (episodes, a line per skipped one).
    A conversation the template cannot render exactly, a recorded sequence the model's
    vocabulary cannot hold, or one longer than the model's context is skipped
    (``skip_unfit``; the line names its file, line and why) or stops the run; a token-level
    row whose reward is below ``min_reward`` is left out (its line says so)."""
    episodes, skipped = [], []
    for index, demo in enumerate(demos):
        if demo.reward is not None and demo.reward < min_reward:
            skipped.append(f"{demo.where}: left out: reward {demo.reward:g} is below "
                           f"sft.min_reward {min_reward:g}")
            continue
        try:
            made = demo.episodes if demo.episodes is not None else [
                conversation_episode(chat, demo.messages, demo.tools, seed=index)]
            for episode in made:
                check_fits(episode, len(chat.tokenizer), max_tokens)
        except DemoError as err:
            if not skip_unfit:
                raise DataError(f"{demo.where}: {err} (sft.skip_unfit true skips such "
                                "rows)") from None
            skipped.append(f"{demo.where}: skipped: {err}")
            continue
        for episode in made:
            episode.info["source"] = demo.where
            episode.seed = episode.group = index
        episodes += made
    return episodes, skipped


def check_fits(episode: Episode, vocabulary: int, max_tokens: int | None) -> None:
    """Refuse a sequence the model cannot train on: no trained token, an id outside its
    vocabulary (a recording made with another model), longer than its context."""
    if not any(episode.loss_mask):
        raise DemoError("no assistant (policy) token: nothing to train on")
    if max(episode.token_ids) >= vocabulary:
        raise DemoError(f"token id {max(episode.token_ids)} is outside the model's vocabulary "
                        f"of {vocabulary} (recorded with another model?)")
    if max_tokens and len(episode.token_ids) > max_tokens:
        raise DemoError(f"{len(episode.token_ids)} tokens, longer than the model's context of "
                        f"{max_tokens}")


def split(count: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices) of ``count`` conversations, seeded; at least one is
    held out when ``fraction`` > 0 and there are two or more, and one always trains."""
    order = np.random.default_rng([seed, 1]).permutation(count).tolist()
    held = min(count - 1, math.ceil(count * fraction)) if fraction > 0 else 0
    return sorted(order[held:]), sorted(order[:held])


def step_indices(count: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The conversations of ``step``: positions step * batch_size ... of an endless stream of
    epochs, each a fresh seeded permutation of range(count); a pure function of its
    arguments, so a resumed run trains on exactly what the uninterrupted one did."""
    picked = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, at = divmod(position, count)
        picked.append(int(np.random.default_rng([seed, 2, epoch]).permutation(count)[at]))
    return picked


def sft_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               episodes: list[Episode], *, pad_id: int, micro_batch_size: int,
               token_budget: int, max_grad_norm: float, compute_dtype: str = "float32"
               ) -> dict[str, float]:
    """One AdamW step on the mean NLL of the assistant tokens of ``episodes``, its matmuls in
    ``compute_dtype`` (``optim.compute_dtype``, as the RL update)."""
    batch = Batch.from_episodes(episodes, torch.zeros(len(episodes)), pad_id)
    count = batch.loss_mask[:, 1:].sum().clamp(min=1)
    device = next(model.parameters()).device
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for part in micro_batches(batch, micro_batch_size, token_budget):
        part = part.to(device)
        with update_autocast(model, compute_dtype):
            nll, _ = policy_nll(model, part)
        (nll / count.to(device)).backward()
        total += float(nll.detach())
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                max_grad_norm or float("inf")))
    metrics = {"sft/loss": total / float(count), "sft/tokens": float(count),
               "grad_norm": norm, "update/skipped": 0.0}
    if math.isfinite(norm):
        optimizer.step()
    else:  # a NaN/inf loss or gradient: never step on it
        optimizer.zero_grad(set_to_none=True)
        metrics["update/skipped"] = 1.0
        warnings.warn(f"optimiser step skipped: the gradient norm is {norm}", stacklevel=2)
    model.eval()
    return metrics


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, episodes: list[Episode], *, pad_id: int,
                  micro_batch_size: int, token_budget: int) -> float | None:
    """Mean NLL per assistant token over ``episodes`` (None when there are none)."""
    if not episodes:
        return None
    batch = Batch.from_episodes(episodes, torch.zeros(len(episodes)), pad_id)
    device = next(model.parameters()).device
    model.eval()
    total, count = 0.0, 0.0
    for part in micro_batches(batch, micro_batch_size, token_budget):
        part = part.to(device)
        nll, tokens = policy_nll(model, part)
        total, count = total + float(nll), count + float(tokens)
    return total / max(count, 1.0)


def without_env_eval(cfg: Config) -> Config:
    """SFT plays no env episodes unless ``sft.eval_env``: the held-out loss measures it."""
    if cfg.sft.eval_env:
        return cfg
    return replace(cfg, eval=replace(cfg.eval, episodes=0, every=0))


def sft(cfg: Config, *, resume: bool = False) -> SftResult:
    """Fine-tune ``cfg``'s model on its demonstrations for ``run.steps`` steps: ``learn`` with
    a ``DemonstrationSource`` (see the module docstring); ``resume`` continues the run in
    ``run.out_dir`` from its last checkpoint."""
    if not cfg.sft.data and not cfg.sft.env_demos and not cfg.sft.self_rounds:
        raise DataError("turnrl sft needs --sft.data FILE.jsonl (a conversation a line in the "
                        "OpenAI chat format), --sft.env_demos N (an env's scripted player) "
                        "or --sft.self_rounds N (the model's own successes)")
    check_rounds(cfg.sft.self_rounds, cfg.run.steps, "the run (run.steps)")
    if cfg.learner.world_size > 1:
        raise ConfigError(f"turnrl sft trains in one process (learner.world_size "
                          f"{cfg.learner.world_size} is for turnrl train); drop "
                          "--learner.world_size")
    # a malformed file stops before anything starts
    demos = read_demonstrations(cfg.sft.data) if cfg.sft.data else []
    # no teacher: distillation is an RL signal (a warm-up would load it for nothing)
    # nor a reward model: demonstrations are trained on as they are
    cfg = replace(without_env_eval(cfg), distill=type(cfg.distill)(),
                  reward=replace(cfg.reward, model=""))
    return learn(cfg, DemonstrationSource(demos), resume=resume)


class DemonstrationSource(SourceDefaults):
    """SFT as ``learn``'s source: each step's seeded batch of demonstrations (``sft.data``'s
    rows, ``sft.env_demos``' scripted episodes, a self-imitation round's successes), trained
    on by the token-NLL ``update`` instead of ``rl_step``; the held-out demonstrations' loss
    is its evaluation (the env's too with ``sft.eval_env``)."""

    def __init__(self, demos: list[Demonstration]) -> None:
        self.demos = demos
        self.step, self.stopped = 0, None
        self.fields: dict[str, str] = {}

    def open(self, run: Run) -> None:
        """Tokenise and split the demonstrations; the held-out loss before training."""
        cfg, self.run = run.cfg, run
        if not run.resumed:  # what a stopped earlier attempt in this directory recorded is stale
            (run.run_dir / STOPPED).unlink(missing_ok=True)
        episodes, self.skipped = demonstration_episodes(run, self.demos)
        train_ids, held_ids = split(len(episodes), cfg.sft.eval_fraction, cfg.run.seed) \
            if episodes else ([], [])
        self.train_set = [episodes[i] for i in train_ids]
        self.held_out_set = [episodes[i] for i in held_ids]
        self.sizes = {"pad_id": run.learner.pad_id, "micro_batch_size": cfg.optim.micro_batch_size,
                      "token_budget": run.learner.settings.token_budget}
        before = run.checkpoint_state.get("sft_loss_before") if run.start_step else None
        self.loss_before = self.loss = before if before is not None else self.held_out_loss()
        if episodes or self.skipped:  # self-imitation alone has no demonstrations to count
            print(f"sft: {len(self.train_set)} sequences to train on, "
                  f"{len(self.held_out_set)} held out, {len(self.skipped)} skipped" + (
                      f"; held-out loss {self.loss:.4f}" if self.loss is not None else ""))
        self.rounds = SelfImitation(run, self.train_set, tokenise) if cfg.sft.self_rounds else None

    def label(self, cfg: Config) -> str:
        return "sft " + (Path(cfg.sft.data).name if cfg.sft.data else f"{cfg.env.name} " + (
            "scripted" if cfg.sft.env_demos else "self-imitation"))

    def held_out(self, cfg: Config) -> str:
        return f"{cfg.env.name}: {cfg.eval.episodes} held-out episodes"

    def collect(self, step: int) -> list[Episode] | None:
        """``sft.batch_size`` conversations, a pure function of (``run.seed``, ``step``): of
        the demonstrations, or of the round's successes and them (None: the round had none,
        and the run stops here, ``SelfImitation.stop``)."""
        cfg, self.step = self.run.cfg, step
        if self.rounds:
            self.train_set = self.rounds.train_set(step)
            if self.train_set is None:  # nothing to imitate
                self.stopped = step
                self.rounds.stop(step)
                return None
        return [self.train_set[i] for i in step_indices(len(self.train_set), cfg.sft.batch_size,
                                                         step, cfg.run.seed)]

    def update(self, learner: Learner, episodes: list[Episode], timer: StageTimer) -> Update:
        """One AdamW step on the batch's mean token NLL (``sft_update``); the held-out loss
        when due (``eval_due``). Demonstrations earn no reward: no summary."""
        cfg = self.run.cfg
        with timer("update"):
            metrics = sft_update(learner.model, learner.optimizer, episodes,
                                 max_grad_norm=cfg.optim.max_grad_norm,
                                 compute_dtype=cfg.optim.compute_dtype, **self.sizes)
        metrics["sft/epoch"] = (self.step + 1) * cfg.sft.batch_size / len(self.train_set)
        if self.held_out_set and eval_due(cfg, self.step):
            with timer("eval"):
                self.loss = metrics["eval/loss"] = self.held_out_loss()
        self.fields = self.rounds.after_step(metrics) if self.rounds else {}
        return None, metrics

    def evaluate(self, run: Run, when: str) -> EvalResult | None:
        """The env's evaluation (``sft.eval_env``); after training, the last round's line
        first (a round's line comes once its steps are done)."""
        if when == "after" and self.rounds:
            self.rounds.end_round()
        return super().evaluate(run, when)

    def progress(self, metrics: dict[str, float]) -> dict:
        return {"loss": metrics["sft/loss"], "held_out": self.loss, **self.fields}

    def state_dict(self) -> dict:
        return {"sft_loss_before": self.loss_before}

    def held_out_loss(self) -> float | None:
        return held_out_loss(self.run.learner.model, self.held_out_set, **self.sizes)

    def result(self, result: TrainResult) -> SftResult:
        """The run's result with the demonstrations' books; the held-out loss table."""
        cfg = self.run.cfg
        steps = cfg.run.steps if self.stopped is None else self.stopped
        if self.held_out_set and self.run.start_step >= cfg.run.steps:  # a finished run resumed
            self.loss = self.held_out_loss()
        if self.held_out_set:
            print_table("held-out demonstrations: mean NLL per assistant token",
                        ["", "loss"], [["before", f"{self.loss_before:.4f}"],
                                       [f"after {steps} steps", f"{self.loss:.4f}"]])
        return SftResult(result.run_dir, steps, result.before, result.after, result.table,
                         len(self.train_set or []), len(self.held_out_set), len(self.skipped),
                         self.loss_before, self.loss if self.held_out_set else None, self.stopped)


def demonstration_episodes(run: Run, demos: list[Demonstration]
                           ) -> tuple[list[Episode], list[str]]:
    """``demos`` and ``sft.env_demos``' scripted episodes, tokenised, and a line (printed)
    per one skipped or left out; ``DataError`` when nothing is left to train on (unless
    self-imitation rounds bring their own)."""
    cfg, chat = run.cfg, run.policy.chat
    scripted, failed = env_demonstrations(cfg.env.name, cfg.env.options, cfg.sft.env_demos,
                                          chat, cfg.rollout.max_turns, cfg.rollout.env_timeout_s)
    demos = demos + scripted
    episodes, skipped = tokenise(chat, demos, skip_unfit=cfg.sft.skip_unfit,
                                 max_tokens=run.policy.max_context,
                                 min_reward=cfg.sft.min_reward)
    skipped = failed + skipped
    for line in skipped:
        print(f"sft: {line}", file=sys.stderr)
    if not episodes and not cfg.sft.self_rounds:
        raise DataError(f"{cfg.sft.data or cfg.env.name}: nothing to train on: all "
                        f"{len(demos) + len(failed)} rows were skipped or left out (the lines "
                        "above say why); no step was taken")
    return episodes, skipped


def eval_due(cfg: Config, step: int) -> bool:
    """Held-out loss after ``step``: every ``sft.eval_every`` steps, else at each checkpoint;
    always after the last."""
    done = step + 1
    every = cfg.sft.eval_every or cfg.run.checkpoint_every
    return done == cfg.run.steps or bool(every and done % every == 0)
