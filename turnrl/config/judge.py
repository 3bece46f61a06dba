"""The ``judge`` config section: an LLM judge scores each training episode against a rubric
(docs/judges.md; the judge is ``turnrl/rewards/judge.py``, its backends
``turnrl/trainer/judges.py``).

Off unless ``model`` or ``base_url`` is set. The judge's score in [0, 1] times ``weight`` is
added to the env's reward of every training episode, in every ``run.mode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from turnrl.config.types import ConfigError, Section


@dataclass(frozen=True)
class JudgeConfig(Section):
    model: str = ""
    """the judge: with base_url, the model name the endpoint serves; without, a local model
    (tiny, smollm2-135m-instruct, a Hugging Face model directory) sampled greedily on TurnRL's
    HF engine. Empty (and no base_url) = off"""
    base_url: str = ""
    """an OpenAI-compatible endpoint (http://host:port/v1: turnrl serve, vLLM, a hosted API)
    the judge is asked through, with the official openai client"""
    api_key_env: str = "OPENAI_API_KEY"
    """the environment variable holding the endpoint's API key (never the key itself, which
    would be saved with the run's config); unset: no key"""
    rubric: str = ""
    """what a good episode is: a file's path or the text itself; it is the judge's system
    message, so the policy's text can never rewrite it"""
    mode: Literal["pointwise", "ranking"] = "pointwise"
    """pointwise: each episode scored alone (a score 0-10 parsed from the reply); ranking: a
    group's episodes scored relative to each other in one call (RULER-style)"""
    weight: float = 1.0
    """the judge's score in [0, 1] times this is added to the env's reward"""
    timeout_s: float = 60.0
    """longest a judge call may take; past it the episodes it scores fail with the reason"""
    max_tokens: int = 64
    """longest judge reply, in tokens"""
    concurrency: int = 8
    """endpoint judge calls in flight at once (the local model judges a step in one batch)"""
    max_chars: int = 6000
    """longest transcript shown to the judge, in characters (the middle is cut, marked)"""

    @property
    def enabled(self) -> bool:
        return bool(self.model or self.base_url)

    def _check(self) -> None:
        self._at_least(1, "max_tokens", "concurrency")
        self._at_least(200, "max_chars")
        self._require("timeout_s", self.timeout_s > 0, "> 0")
        self._require("weight", abs(self.weight) < 1e6, "a finite number within ±1e6")
        if self.enabled and not self.rubric.strip():
            raise ConfigError("judge.rubric is empty: a judge needs a rubric; pass "
                              "--judge.rubric FILE or --judge.rubric 'TEXT'")
        if self.base_url and not self.model:
            raise ConfigError("judge.base_url needs judge.model (the model name the endpoint "
                              "serves); pass --judge.model NAME")
        if self.base_url and not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"judge.base_url {self.base_url!r} is not an http(s) URL; "
                              "pass e.g. http://127.0.0.1:8000/v1")
