"""Episodes recorded from served calls: exact token ids, merged across the calls of an episode.

Each call of an episode (the ``X-TurnRL-Episode`` header or the ``turnrl_episode`` body field)
adds its prompt token ids and the sampled ids with their log-probabilities and policy version.
A call whose prompt ids start with every token of an earlier call's sequence (its prompt and
reply) *extends* it: only the new prompt tokens (the agent's tool results, user turns, the
template's markers) are appended, with loss mask 0, then the sampled tokens with mask 1 — one
multi-turn sequence, as the turn loop builds it. A call that extends none (the agent
summarised, dropped or edited earlier messages) starts a new *segment*. Every segment of an
episode is trained with the episode's one reward (``training_episodes``).

``prompt_ids`` builds the prompt so that a call which only appends messages does extend: the
rendered text past the earlier sequence's text is tokenised on its own and appended to its
ids (token-in-token-out, as ``ChatFormat.continue_after``), never re-tokenising what the model
sampled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from turnrl import safe_json
from turnrl.types import ENV_VERSION, Episode, Turn


@dataclass
class Segment:
    """One token sequence of an episode: the calls that extended each other."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    """The rendered text of ``token_ids`` (how the next prompt is matched against it)."""
    spans: list[tuple[int, int]] = field(default_factory=list)
    """(start, end) of each call's sampled tokens."""
    temperatures: list[float] = field(default_factory=list)
    """The sampling temperatures its calls used (the update must score at the same one)."""


@dataclass
class Call:
    """What one served call fed the engine and what it sampled."""

    prompt_ids: list[int]
    prompt_text: str
    sampled_ids: list[int]
    logprobs: list[float]
    version: int
    reply_text: str
    """The text of the sampled ids as they render in the conversation (end of turn included
    when the model sampled it)."""
    temperature: float = 1.0


def prompt_ids(segments: list[Segment], rendered: str, encode: Callable[[str], list[int]]
               ) -> list[int]:
    """Token ids of the prompt ``rendered``: the longest segment whose text it starts with,
    plus the new text tokenised alone; the whole text tokenised when it extends none."""
    best = max((s for s in segments if s.text and rendered.startswith(s.text)),
               key=lambda s: len(s.text), default=None)
    if best is None:
        return encode(rendered)
    return best.token_ids + encode(rendered[len(best.text):])


def extended_segment(segments: list[Segment], prompt: list[int]) -> int | None:
    """Index of the longest segment whose token ids ``prompt`` starts with (None: a rewrite)."""
    best, length = None, -1
    for i, s in enumerate(segments):
        n = len(s.token_ids)
        if n > length and n <= len(prompt) and prompt[:n] == s.token_ids:
            best, length = i, n
    return best


def merge_call(segments: list[Segment], call: Call) -> int:
    """Add ``call`` to ``segments`` (in place): appended to the segment its prompt extends,
    else as a new segment. Returns the segment's index."""
    index = extended_segment(segments, call.prompt_ids)
    if index is None:
        segments.append(Segment())
        index = len(segments) - 1
    segment = segments[index]
    new = call.prompt_ids[len(segment.token_ids):]
    segment.token_ids += new
    segment.loss_mask += [0] * len(new)
    segment.logprobs += [0.0] * len(new)
    segment.versions += [ENV_VERSION] * len(new)
    start = len(segment.token_ids)
    segment.token_ids += call.sampled_ids
    segment.loss_mask += [1] * len(call.sampled_ids)
    segment.logprobs += list(call.logprobs)
    segment.versions += [call.version] * len(call.sampled_ids)
    segment.spans.append((start, len(segment.token_ids)))
    segment.text = call.prompt_text + call.reply_text
    if call.temperature not in segment.temperatures:
        segment.temperatures.append(call.temperature)
    return index


@dataclass
class RecordedEpisode:
    episode_id: str
    segments: list[Segment] = field(default_factory=list)
    calls: int = 0
    reward: float | None = None
    started_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return asdict(self)


def training_episodes(recorded: RecordedEpisode, group: int, env: str = "served"
                      ) -> list[Episode]:
    """One ``Episode`` per segment, each carrying the episode's reward (segments share it:
    every policy token of the episode is credited with the one outcome, as each turn of a
    multi-turn episode is). Raises ValueError for an episode without a reward."""
    if recorded.reward is None:
        raise ValueError(f"episode '{recorded.episode_id}' has no reward; set one with "
                         "POST /v1/turnrl/episodes/ID/reward or Recorder.set_reward")
    out = []
    for k, s in enumerate(recorded.segments):
        turns = [Turn(start, end, "", "", 0.0) for start, end in s.spans]
        out.append(Episode(env=env, seed=group, group=group, token_ids=list(s.token_ids),
                           loss_mask=list(s.loss_mask), logprobs=list(s.logprobs),
                           versions=list(s.versions), turns=turns, reward=recorded.reward,
                           success=recorded.reward > 0, status="done", end_reason="done",
                           info={"episode_id": recorded.episode_id, "segment": k,
                                 "segments": len(recorded.segments)}))
    return out


class Recorder:
    """Recorded episodes by id; the server's event loop is its only writer."""

    def __init__(self, record_dir: str = ""):
        self.episodes: dict[str, RecordedEpisode] = {}
        self.record_dir = Path(record_dir) if record_dir else None
        self.started = 0
        """Episode ids ever recorded (``episodes`` loses those training takes)."""
        self.recorded_calls = 0

    def segments(self, episode_id: str | None) -> list[Segment]:
        recorded = self.episodes.get(episode_id) if episode_id else None
        return recorded.segments if recorded else []

    def record(self, episode_id: str, call: Call) -> int:
        self.started += episode_id not in self.episodes
        self.recorded_calls += 1
        recorded = self.episodes.setdefault(episode_id, RecordedEpisode(episode_id))
        recorded.calls += 1
        return merge_call(recorded.segments, call)

    def set_reward(self, episode_id: str, reward: float) -> None:
        """Score a recorded episode: ``KeyError`` for an id never recorded, ``ValueError``
        (one line) for a reward that is not a finite number within ``REWARD_LIMIT``."""
        if episode_id not in self.episodes:
            raise KeyError(f"no episode '{episode_id}' was recorded (its calls must carry the "
                           "X-TurnRL-Episode header or the turnrl_episode body field)")
        problem = Episode("served", 0, 0).reward_problem(reward)
        if problem is not None:
            raise ValueError(f"episode '{episode_id}': {problem}")
        self.episodes[episode_id].reward = float(reward)
        if self.record_dir is not None:
            self.record_dir.mkdir(parents=True, exist_ok=True)
            with open(self.record_dir / "episodes.jsonl", "a") as f:
                f.write(safe_json.dumps(self.episodes[episode_id].to_dict()) + "\n")

    def take(self, episode_ids: list[str]) -> list[RecordedEpisode]:
        """Remove and return these episodes (those never recorded are skipped)."""
        return [self.episodes.pop(e) for e in episode_ids if e in self.episodes]

    def unrewarded(self) -> list[str]:
        return [e for e, r in self.episodes.items() if r.reward is None]
