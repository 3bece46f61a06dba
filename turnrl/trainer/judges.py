"""Where an LLM judge's replies come from, and building the judge a config asks for.

``EndpointBackend``: any OpenAI-compatible endpoint (``turnrl serve``, vLLM, a hosted API)
through the official ``openai`` client, ``judge.concurrency`` calls in flight, each within
``judge.timeout_s``. ``LocalBackend``: a local model (the tiny model, SmolLM2, a Hugging Face
directory) on TurnRL's own HF engine, greedy, the step's chats in one batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Sequence
from pathlib import Path

from turnrl.rewards.judge import EpisodeJudge


class EndpointBackend:
    """Judge calls to an OpenAI-compatible ``base_url`` serving ``model``."""

    def __init__(self, base_url: str, model: str, api_key: str = "", *, timeout_s: float = 60.0,
                 max_tokens: int = 64, concurrency: int = 8) -> None:
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.timeout_s, self.max_tokens, self.concurrency = timeout_s, max_tokens, concurrency

    def complete(self, chats: Sequence[list[dict]]) -> list[str | BaseException]:
        """Every chat's reply (or its error), asked concurrently on an event loop of our own
        (a thread when the caller already runs one: a served run's agents)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self._all(chats))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self._all(chats)).result()

    async def _all(self, chats: Sequence[list[dict]]) -> list[str | BaseException]:
        from openai import AsyncOpenAI

        gate = asyncio.Semaphore(self.concurrency)
        async with AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "unused",
                               max_retries=0, timeout=self.timeout_s) as client:
            async def one(chat: list[dict]) -> str:
                async with gate:
                    reply = await asyncio.wait_for(client.chat.completions.create(
                        model=self.model, messages=chat, temperature=0,
                        max_tokens=self.max_tokens), self.timeout_s)
                try:
                    content = reply.choices[0].message.content
                except (AttributeError, IndexError, TypeError):
                    raise ValueError("the reply has no choices[0].message.content") from None
                return content if isinstance(content, str) else ""
            return await asyncio.gather(*(one(c) for c in chats), return_exceptions=True)

    def close(self) -> None:
        pass  # a client lives for one complete() call


class LocalBackend:
    """A local model judging greedily on its own HF engine; a batch past ``timeout_s`` fails
    every chat in it (the batch is not interrupted: its thread finishes in the background)."""

    def __init__(self, name: str, *, dtype: str = "float32", cache_dir: str | None = None,
                 timeout_s: float = 60.0, max_tokens: int = 64, seed: int = 0) -> None:
        from turnrl.models import load_model
        from turnrl.rollout import ChatFormat
        from turnrl.samplers import SamplingParams, chooser

        model, tokenizer = load_model(name, dtype=dtype, cache_dir=cache_dir)
        self.model = model.eval().requires_grad_(False)
        self.chat = ChatFormat(tokenizer)
        self.engine = chooser.build("hf", "auto", self.model, tokenizer.pad_token_id, seed=seed,
                                    reuse_cache=False, announce=True, who=f"judge {name}")
        self.params = SamplingParams(max_tokens, 0.0, 1.0,
                                     stop_token_ids=(self.chat.end_of_turn,))
        self.context = getattr(model.config, "max_position_embeddings", None)
        self.timeout_s, self.name = timeout_s, name
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="judge")

    def complete(self, chats: Sequence[list[dict]]) -> list[str | BaseException]:
        prompts = [self.chat.start(c[1]["content"], c[0]["content"])[2] for c in chats]
        room = None if self.context is None else self.context - self.params.max_new_tokens
        fits = [i for i, p in enumerate(prompts) if room is None or len(p) <= room]
        out: list[str | BaseException] = [ValueError(
            f"the judge prompt is {len(p)} tokens, past the {self.name} judge's context "
            f"{self.context} less judge.max_tokens; lower judge.max_chars") for p in prompts]
        if fits:
            future = self.pool.submit(self.engine.generate, [prompts[i] for i in fits],
                                      self.params)
            try:
                done = future.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                done = [TimeoutError()] * len(fits)
            except Exception as err:  # noqa: BLE001 - every chat of the batch fails with it
                done = [err] * len(fits)
            for i, completion in zip(fits, done, strict=True):
                out[i] = completion if isinstance(completion, BaseException) else self._text(
                    completion)
        return out

    def _text(self, completion) -> str:
        tokens = completion.token_ids
        if completion.finish_reason == "stop":
            tokens = tokens[:-1]
        return self.chat.tokenizer.decode(tokens, skip_special_tokens=True)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def rubric_text(rubric: str) -> str:
    """``judge.rubric``: a file's text when it names a file, else the text itself."""
    path = Path(rubric).expanduser()
    looks_like_path = "\n" not in rubric and len(rubric) < 1024 and rubric.strip().endswith(
        (".md", ".txt", ".rubric"))
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"judge.rubric {rubric!r} cannot be read ({err}); pass a readable "
                         "UTF-8 file or the rubric's text") from None
    if looks_like_path:
        raise ValueError(f"judge.rubric file {rubric!r} does not exist; pass an existing file or "
                         "the rubric's text")
    return rubric


def build_judge(cfg, tokenizer) -> EpisodeJudge | None:
    """The judge ``cfg.judge`` asks for (None: off); transcripts are decoded with the policy's
    ``tokenizer``."""
    j = cfg.judge
    if not j.enabled:
        return None
    rubric = rubric_text(j.rubric)
    if j.base_url:
        backend = EndpointBackend(j.base_url, j.model, os.environ.get(j.api_key_env, ""),
                                  timeout_s=j.timeout_s, max_tokens=j.max_tokens,
                                  concurrency=j.concurrency)
    else:
        backend = LocalBackend(j.model, dtype=cfg.model.dtype,
                               cache_dir=cfg.model.cache_dir or None, timeout_s=j.timeout_s,
                               max_tokens=j.max_tokens, seed=cfg.run.seed)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return EpisodeJudge(backend, rubric, decode, mode=j.mode, weight=j.weight,
                        timeout_s=j.timeout_s, max_chars=j.max_chars)
