"""The data that flows through TurnRL: turns, episodes and training batches.

Every token of an episode carries its facts side by side (AReaL's multi-turn workflow keeps
the same columns): whether the policy sampled it (``loss_mask``), the log-probability the
behaviour policy gave it, and the policy version that produced it. Environment and template
tokens have mask 0, log-probability 0.0 and version -1.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from turnrl import safe_json
from turnrl.safe_json import json_safe, safe_repr

ENV_VERSION = -1
"""Version tag of tokens the policy did not sample (prompt, template, environment)."""

END_REASONS = {
    "done": "the env said done",
    "turn_limit": "rollout.max_turns turns were played",
    "context_length": "the next env reply and a whole reply would not fit the model's context",
    "input_too_large": "an env text (prompt, system prompt, observation, tool results) was "
                       "longer than the context could hold, so it was refused before "
                       "rendering or tokenising",
    "env_timeout": "an env reset or step ran past rollout.env_timeout_s",
    "env_error": "an env reset or step raised, or returned a malformed value (a reward "
                 "that is not a finite number, or that makes the return not finite: "
                 "REWARD_LIMIT)",
    "judge_error": "the LLM judge (judge.*) failed, timed out or replied with no score; the "
                   "episode is left out of the update",
}
"""``Episode.end_reason`` values: why an episode ended (details in ``info["reason"]``)."""


REWARD_LIMIT = 1e15
"""Largest magnitude a turn's reward, an episode's return and the sum of its turns' reward
magnitudes (which bounds every discounted return the credit code computes) may have. Each
reward can be finite while their sum is not (three rewards of -1e308), and the update
computes advantages in float32, where a group's squared deviations overflow long before
float64 does: past this bound the advantages would come out NaN (the whole step's update
skipped) or silently 0. An episode whose reward passes it fails alone (``Episode.add_turn``)."""


def finite_real(value: object) -> bool:
    """``value`` is a real number (not a bool) finite as a float; never raises (an int past
    float's range is not, where ``math.isfinite`` would raise ``OverflowError``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except (OverflowError, TypeError, ValueError):
        return False


@dataclass
class Turn:
    """One policy action and what the environment answered.

    ``start:end`` is the span of the policy's sampled tokens inside ``Episode.token_ids``.
    ``state`` names the environment state the action was taken in: the environment's
    ``state_key`` (its attribute after ``reset``, then ``info["state_key"]`` of each step)
    when it gives one, else the observation the policy answered
    (GiGPO groups actions taken in the same state across the episodes of a group).
    """

    start: int
    end: int
    action: str
    observation: str
    reward: float
    finish_reason: str = "stop"  # "stop" (end-of-turn token) or "length" (max_new_tokens)
    state: str = ""


@dataclass
class Episode:
    """A whole multi-turn interaction, as token ids with per-token facts."""

    env: str
    seed: int
    group: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    status: str = "running"  # running | done | truncated | timeout | error
    info: dict = field(default_factory=dict)
    end_reason: str = ""
    """Why the episode ended, one of ``END_REASONS`` ("" while running, and in files written
    before it existed); the details, when there are any, are in ``info["reason"]``."""

    def end(self, status: str, end_reason: str, detail: str | None = None) -> None:
        """End the episode: its status, why (``END_REASONS``) and, if given, the details."""
        self.status, self.end_reason = status, end_reason
        if detail is not None:
            self.info["reason"] = detail

    def reward_problem(self, reward: object) -> str | None:
        """Why ``reward`` cannot be added to this episode (not a real number, or it, the
        return it makes or the turns' summed magnitudes not finite within ``REWARD_LIMIT``),
        else None."""
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            return (f"env '{self.env}' gave reward {safe_repr(reward)}, not a number; return "
                    "a finite number")
        value = float(reward) if finite_real(reward) else math.inf
        sizes = (("reward", value), ("return", self.reward + value),
                 ("turns' summed |reward|", sum(abs(t.reward) for t in self.turns) + abs(value)))
        for what, number in sizes:
            if not (math.isfinite(number) and abs(number) <= REWARD_LIMIT):
                effect = "is" if what == "reward" else f"makes the episode's {what} {number:g},"
                turn = f" (turn {len(self.turns) + 1})" if self.token_ids else ""
                return (f"env '{self.env}' gave reward {safe_repr(reward)}{turn}: it {effect} "
                        f"not a finite number within ±{REWARD_LIMIT:g} (the update's float32 "
                        "maths would overflow); keep rewards and their sum within that")
        return None

    def add_turn(self, turn: Turn) -> bool:
        """Append ``turn`` and add its reward to the return: the one check on the way in
        (``reward_problem``). A reward that fails it fails this episode alone ("error",
        ``env_error``, the reason in ``info``), the turn kept unrewarded; returns False."""
        return self.add_reward(turn.reward, turn)

    def add_reward(self, reward: object, turn: Turn | None = None) -> bool:
        """Add ``reward`` (with ``turn``, the turn that earned it, appended) to the return;
        False, the episode failed with the reason, when ``reward_problem`` finds one."""
        problem = self.reward_problem(reward)
        if turn is not None:
            self.turns.append(turn if problem is None else replace(turn, reward=0.0))
        if problem is not None:
            self.end("error", "env_error", problem)
            return False
        self.reward += float(reward)
        return True

    def append(self, ids: Sequence[int], *, policy: bool, logprobs: Sequence[float] = (),
               version: int = ENV_VERSION) -> tuple[int, int]:
        """Append tokens and their facts; return their span in ``token_ids``."""
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if policy else 0] * len(ids))
        self.logprobs.extend(logprobs if policy else [0.0] * len(ids))
        self.versions.extend([version if policy else ENV_VERSION] * len(ids))
        if not (len(self.token_ids) == len(self.loss_mask) == len(self.logprobs)
                == len(self.versions)):
            raise ValueError("episode columns out of step: logprobs must match the policy tokens")
        return start, len(self.token_ids)

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_json(self) -> str:
        """One line of valid JSON (``safe_json.dumps``: a NaN or infinity is written as
        ``null``). ``info`` is made JSON-safe where an env's values enter it (``safe_json``);
        should code after that have put something else there, it is made safe here too
        rather than failing the write."""
        data = asdict(self)
        try:
            return safe_json.dumps(data)
        except (TypeError, ValueError, RecursionError):
            data["info"] = json_safe(self.info)
            return safe_json.dumps(data)

    @classmethod
    def from_json(cls, line: str) -> Episode:
        data = json.loads(line)
        data["turns"] = [Turn(**t) for t in data["turns"]]
        return cls(**data)


def write_episodes(path: str | Path, episodes: Iterable[Episode]) -> None:
    """Write episodes as JSONL (one episode a line), readable with ``read_episodes``.

    All or nothing: every line is serialised before anything is written, into a temporary
    file that replaces ``path`` once complete, so a crash never leaves a partial record."""
    path = Path(path)
    text = "".join(ep.to_json() + "\n" for ep in episodes)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_episodes(path: str | Path) -> list[Episode]:
    """Episodes of a JSONL file; an unreadable last line (torn by a crash while a run from
    before writes were atomic was writing it) is skipped, corruption elsewhere raises."""
    lines = [line for line in Path(path).read_text(errors="replace").splitlines()
             if line.strip()]
    episodes = []
    for number, line in enumerate(lines, 1):
        try:
            episodes.append(Episode.from_json(line))
        except (ValueError, TypeError, KeyError):
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: corrupt episode line") from None
    return episodes


@dataclass
class Batch:
    """Episodes padded on the right into tensors for the update.

    Shapes: ``input_ids``, ``attention_mask``, ``loss_mask``, ``old_logprobs`` [B, T];
    ``advantages`` [B] (one per episode) or [B, T] (per token, for turn-level credit).
    ``loss_mask[b, t]`` marks that token ``t`` was sampled by the policy; the update scores
    it from the logits at position ``t - 1``. ``old_logprobs`` are the behaviour policy's
    (the sampler's); ``prox_logprobs`` [B, T], when set, are the proximal policy's (the
    weights right before this update) for decoupled PPO.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    prox_logprobs: torch.Tensor | None = None

    @classmethod
    def from_episodes(cls, episodes: Sequence[Episode], advantages: torch.Tensor,
                      pad_id: int) -> Batch:
        length = max(len(ep.token_ids) for ep in episodes)
        shape = (len(episodes), length)
        input_ids = torch.full(shape, pad_id, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        loss_mask = torch.zeros(shape, dtype=torch.float32)
        old_logprobs = torch.zeros(shape, dtype=torch.float32)
        for row, ep in enumerate(episodes):
            n = len(ep.token_ids)
            input_ids[row, :n] = torch.tensor(ep.token_ids)
            attention_mask[row, :n] = 1
            loss_mask[row, :n] = torch.tensor(ep.loss_mask, dtype=torch.float32)
            old_logprobs[row, :n] = torch.tensor(ep.logprobs, dtype=torch.float32)
        return cls(input_ids, attention_mask, loss_mask, old_logprobs, advantages)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(None if t is None else t.to(device)
                       for t in (self.input_ids, self.attention_mask, self.loss_mask,
                                 self.old_logprobs, self.advantages, self.prox_logprobs)))

    def select(self, rows: slice | torch.Tensor) -> Batch:
        """A micro-batch, trimmed of trailing all-padding columns."""
        width = int(self.attention_mask[rows].sum(dim=1).max())
        return Batch(
            input_ids=self.input_ids[rows, :width],
            attention_mask=self.attention_mask[rows, :width],
            loss_mask=self.loss_mask[rows, :width],
            old_logprobs=self.old_logprobs[rows, :width],
            advantages=self.advantages[rows] if self.advantages.dim() == 1
            else self.advantages[rows, :width],
            prox_logprobs=None if self.prox_logprobs is None
            else self.prox_logprobs[rows, :width],
        )
