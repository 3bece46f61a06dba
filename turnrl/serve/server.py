"""The served policy: one chat completion from checked request to choices, recorded.

``Server`` holds the model, its chat format, the engine (shared with the trainer when
training through the endpoint: the served weights *are* the trained ones), the batcher and
the recorder. ``app.py`` puts it behind HTTP.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from dataclasses import dataclass

import torch

from turnrl.config import Config, ServeConfig
from turnrl.policy import Policy, load_policy, publish
from turnrl.rollout import ChatFormat
from turnrl.samplers import Completion, SamplingParams
from turnrl.serve.batcher import Batcher
from turnrl.serve.prompt import ReplyMemory, call_format, forced_call, render, split_reply
from turnrl.serve.protocol import ApiError, ChatRequest, bad
from turnrl.serve.record import Call, Recorder, prompt_ids
from turnrl.serve.stream import CALL_TAG, ReplyStream, byte_token_ids


@dataclass
class Choice:
    """One served choice: what the client sees and what was sampled for it."""

    content: str | None
    tool_calls: list[dict]
    finish_reason: str
    token_ids: list[int]
    """Sampled ids kept (cut after a stop string), the end-of-turn token included if sampled."""
    logprobs: list[float]
    visible: int
    """How many of ``token_ids`` the client sees (the end-of-turn token is not shown)."""
    top_logprobs: list[list[tuple[str, float]]] | None = None
    """With ``top_logprobs``: the likeliest (token, logprob) at each shown position."""


def cut_at_stop(text_of, ids: list[int], stops: tuple[str, ...]) -> tuple[int, int] | None:
    """(tokens to keep, characters of text to keep) when a stop string occurs in the text of
    ``ids``: the text ends before it (OpenAI's rule) and the tokens at the one that completed
    it. None when no stop string occurs. ``text_of(ids) -> str``."""
    text = text_of(ids)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not hits:
        return None
    at = min(hits)
    end = at + min(len(s) for s in stops if text.find(s) == at)
    for k in range(1, len(ids) + 1):
        if len(text_of(ids[:k])) >= end:
            return k, at
    return len(ids), at


class Server:
    def __init__(self, model: torch.nn.Module, chat: ChatFormat, engine, *, name: str,
                 max_context: int | None, cfg: ServeConfig):
        self.model, self.chat, self.engine = model, chat, engine
        self.tokenizer = chat.tokenizer
        self.name, self.max_context, self.cfg = name, max_context, cfg
        self.weights_lock = threading.Lock()
        self.batcher = Batcher(engine, self.weights_lock, cfg.max_batch_rows, cfg.batch_window_s)
        self.recorder = Recorder(cfg.record_dir)
        self.replies = ReplyMemory()
        self.format = call_format(chat)
        self.byte_tokens = byte_token_ids(self.tokenizer)
        self.counts = Counter()
        """Completions served, their prompt and completion tokens (``/metrics``)."""

    @classmethod
    def from_policy(cls, policy: Policy, cfg: Config) -> Server:
        return cls(policy.model, policy.chat, policy.engine,
                   name=cfg.serve.model_name or cfg.model.name, max_context=policy.max_context,
                   cfg=cfg.serve)

    # ---- one chat completion ----------------------------------------------------------

    def prompt(self, request: ChatRequest) -> tuple[str, list[int], SamplingParams, str]:
        """The rendered prompt, its token ids, the sampling settings and the forced start of
        a tool call (part of the prompt: "" unless tool_choice forces one); 404/400 on bad
        input."""
        if request.model != self.name:
            raise ApiError(404, f"the model '{request.model}' does not exist; this server "
                           f"serves '{self.name}' (serve.model_name sets the name it answers to)",
                           param="model", code="model_not_found")
        tools = request.tools if request.tool_choice != "none" else None
        try:
            text = render(self.chat, request.messages, self.replies, tools)
        except Exception as err:  # noqa: BLE001 - a template refusing the messages is bad input
            raise bad(f"the chat template cannot render these messages: {err}",
                      "messages") from None
        # "required" or a named function: the call's opening is written for the model, as
        # prompt text, so it can only go on with a call (and its tokens get no loss).
        forced = forced_call(self.format, request.tool_choice) if tools else ""
        text += forced
        ids = prompt_ids(self.recorder.segments(request.episode), text, self.chat.encode)
        max_new = request.max_tokens or self.cfg.max_tokens
        if self.max_context:
            room = self.max_context - len(ids)
            if room < 1 or (request.max_tokens and request.max_tokens > room):
                raise bad(f"this model's context is {self.max_context} tokens; the messages "
                          f"take {len(ids)} and max_tokens asks for "
                          f"{request.max_tokens or 'at least 1'} more: shorten the messages "
                          "or lower max_tokens", "messages", "context_length_exceeded")
            max_new = min(max_new, room)
        params = SamplingParams(max_new, request.temperature, request.top_p,
                                stop_token_ids=(self.chat.end_of_turn,))
        return text, ids, params, forced

    async def complete(self, request: ChatRequest, stream: asyncio.Queue | None = None,
                       prepared: tuple | None = None) -> tuple[list[Choice], int]:
        """Generate, shape and record the choices; returns them and the prompt's length.
        ``stream`` gets each choice's tokens as they are sampled (``Batcher.generate``);
        ``prepared``: what ``prompt(request)`` returned, if it was called already."""
        text, ids, params, forced = prepared or self.prompt(request)
        completions, version = await self.batcher.generate(ids, params, request.n, stream)
        tools = request.tools if request.tool_choice != "none" else None
        choices = [self._choice(c, request, tools, forced) for c in completions]
        self.counts.update(completions=1, choices=len(choices), prompt_tokens=len(ids),
                           completion_tokens=sum(len(c.token_ids) for c in choices))
        if request.top_logprobs and version is not None:
            await asyncio.to_thread(self._score_top, ids, choices, request, version)
        for choice in choices:
            raw = self.tokenizer.decode(choice.token_ids[:choice.visible])
            # What the model "wrote" includes the forced opening: the agent's next call
            # renders it so, and extends this prompt token for token.
            self.replies.remember(choice.content, choice.tool_calls, forced + raw)
            if request.episode and version is not None:  # None: two policies sampled it
                stopped = choice.visible < len(choice.token_ids)
                reply = raw + (self.chat.end_of_turn_text if stopped else "")
                self.recorder.record(request.episode, Call(ids, text, choice.token_ids,
                                                           choice.logprobs, version, reply,
                                                           request.temperature))
        return choices, len(ids)

    def _choice(self, completion: Completion, request: ChatRequest, tools, forced: str = ""
                ) -> Choice:
        token_ids, logprobs = completion.token_ids, completion.logprobs
        stopped = completion.finish_reason == "stop"
        visible = len(token_ids) - stopped
        finish = "stop" if stopped else "length"
        text = self.tokenizer.decode(token_ids[:visible])
        if request.stop and (cut := cut_at_stop(self.tokenizer.decode, token_ids[:visible],
                                                request.stop)):
            keep, chars = cut
            token_ids, logprobs, visible = token_ids[:keep], logprobs[:keep], keep
            text, finish = text[:chars], "stop"
        content, calls = split_reply(forced + text, self.format) if tools else (text, [])
        if calls:
            finish = "tool_calls"
        return Choice(content, calls, finish, list(token_ids), list(logprobs), visible)

    def _score_top(self, prompt: list[int], choices: list[Choice], request: ChatRequest,
                   version: int) -> None:
        """Each choice's ``top_logprobs``: one forward pass over prompt and reply, under the
        weights lock and only while the weights that sampled it are served, at the
        request's temperature (greedy: 1, as the sampled tokens' log-probabilities)."""
        with self.weights_lock, torch.no_grad():
            if self.engine.version != version:
                return  # updated meanwhile: no alternatives rather than other weights' ones
            was_training = self.model.training
            self.model.eval()
            try:
                device = next(self.model.parameters()).device
                for choice in choices:
                    reply = choice.token_ids[:choice.visible]
                    ids = torch.tensor([prompt + reply], device=device)
                    logits = self.model(ids).logits[0, len(prompt) - 1:-1].float()
                    logprobs = torch.log_softmax(logits / (request.temperature or 1.0), -1)
                    values, tokens = logprobs.topk(request.top_logprobs, dim=-1)
                    choice.top_logprobs = [
                        list(zip(self.token_texts(row), lps, strict=True))
                        for row, lps in zip(tokens.tolist(), values.tolist(), strict=True)]
            finally:
                self.model.train(was_training)

    def reply_stream(self, request: ChatRequest, forced: str) -> ReplyStream:
        """What of a choice can be streamed while it is generated: with tools, content up to
        a call's tag (the call follows as ``tool_calls``); nothing early when the call is
        forced or the format is bare JSON (any text may turn out to be a call)."""
        tools = bool(request.tools) and request.tool_choice != "none"
        return ReplyStream(self.tokenizer.decode, request.stop, (CALL_TAG,) if tools else (),
                           (self.chat.end_of_turn,),
                           buffered=bool(forced) or (tools and self.format != "hermes"),
                           byte_tokens=self.byte_tokens)

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]


def with_checkpoint_lora(cfg: Config, checkpoint) -> Config:
    """``cfg`` with the ``model.lora`` section of the run that wrote ``checkpoint`` when that
    holds a LoRA adapter and ``cfg`` names none: the adapter is served on the base it was
    trained on without repeating its rank on the command line."""
    from dataclasses import replace

    from turnrl.checkpoint import holds_adapter
    from turnrl.models import checkpoint_model_section

    if cfg.model.lora or not holds_adapter(checkpoint):
        return cfg
    lora = checkpoint_model_section(str(checkpoint)).get("lora") or {}
    return replace(cfg, model=replace(cfg.model, lora=dict(lora)))


def load_server(cfg: Config) -> Server:
    """The model of ``cfg`` (and ``serve.checkpoint``'s weights), ready to serve."""
    from pathlib import Path

    from turnrl.checkpoint import is_checkpoint, load_weights
    from turnrl.models import configure_torch

    configure_torch(cfg.run.threads)
    if cfg.serve.checkpoint:
        cfg = with_checkpoint_lora(cfg, Path(cfg.serve.checkpoint))
    policy = load_policy(cfg)
    if cfg.serve.checkpoint:
        checkpoint = Path(cfg.serve.checkpoint)
        if not is_checkpoint(checkpoint):
            raise FileNotFoundError(f"no checkpoint at '{checkpoint}'; pass --serve.checkpoint "
                                    "RUN_DIR/checkpoints/step-NNNNNN")
        load_weights(checkpoint, policy.model)  # a LoRA run's: its adapter
        state = json.loads((checkpoint / "state.json").read_text())
        # recorded tokens carry the checkpoint's step; an engine with its own weights reloads
        publish(policy.engine, policy.model, state["step"])
    return Server.from_policy(policy, cfg)
