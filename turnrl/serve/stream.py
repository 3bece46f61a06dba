"""Live streaming of one choice: which part of a reply being generated can be sent already.

Tokens arrive one decode step at a time; the text sent must only ever grow into the reply's
final content (what the same call returns without ``stream``), so some text is held back
until later tokens settle it (``safe_text``):

- an incomplete UTF-8 character (a multi-byte character split across tokens decodes as
  U+FFFD until its last byte arrives), and a trailing run of byte-fallback tokens
  (``<0xNN>``, SentencePiece tokenizers): their decoder turns the whole run into U+FFFD if a
  later byte makes it invalid UTF-8, so the text of a run is settled only once a token
  that is not a byte ends it;
- a possible start of a ``stop`` string at the end (the content ends before a stop string,
  which is never sent), and everything from a complete one on;
- with tools: a possible start of the ``<tool_call>`` tag, everything from a complete one on
  (the call goes out as a ``tool_calls`` delta once parsed), and trailing whitespace (the
  content before a call is sent without it).

The rest of the content, the calls and the finish reason follow when the choice is final.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable

CALL_TAG = "<tool_call>"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def byte_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's byte-fallback tokens (``<0x00>`` to ``<0xFF>``); none for
    byte-level BPE (GPT-2 style), whose decoding only ever adds to a prefix's text."""
    return frozenset(i for token, i in tokenizer.get_vocab().items()
                     if len(token) == 6 and _BYTE_TOKEN.fullmatch(token))


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper start of a marker."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


def safe_text(text: str, stops: tuple[str, ...], tags: tuple[str, ...] = (),
              hold_space: bool = False) -> str:
    """The longest start of ``text`` that the final content surely starts with."""
    text = text.rstrip("\ufffd")  # an incomplete character: its bytes are still coming
    end = len(text) - held_suffix(text, stops + tags)
    for marker in stops + tags:
        at = text.find(marker)
        if 0 <= at < end:
            end = at
    kept = text[:end]
    return kept.rstrip() if hold_space else kept


class ReplyStream:
    """One choice's sampled tokens as they come, and what of them can be sent.

    ``decode(ids) -> str``; ``hidden`` token ids (the end of turn) are never shown;
    ``byte_tokens``: the tokenizer's byte-fallback ids; ``buffered`` sends nothing before the
    end (a forced tool call, a bare-JSON call format).
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...],
                 tags: tuple[str, ...], hidden: tuple[int, ...], buffered: bool = False,
                 byte_tokens: frozenset[int] = frozenset()):
        self.decode, self.stops, self.tags, self.hidden = decode, stops, tags, hidden
        self.buffered, self.byte_tokens = buffered, byte_tokens
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.ends: list[int] = []
        """Length of the text once each token had arrived (when its logprob can be sent)."""
        self.sent = ""
        self.sent_tokens = 0

    def add(self, token: int, logprob: float) -> None:
        if token not in self.hidden:
            self.ids.append(token)
            self.logprobs.append(logprob)

    def take(self) -> tuple[str, list[int], list[float]]:
        """New text that can be sent, and the tokens (ids, logprobs) it completes."""
        settled = len(self.ids)
        while settled and self.ids[settled - 1] in self.byte_tokens:
            settled -= 1
        if self.buffered or len(self.ends) == settled:
            return "", [], []
        text = self.decode(self.ids[:settled])
        self.ends += [len(text.rstrip("\ufffd"))] * (settled - len(self.ends))
        safe = safe_text(text, self.stops, self.tags, hold_space=bool(self.tags))
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return "", [], []
        new, self.sent = safe[len(self.sent):], safe
        start = self.sent_tokens
        while self.sent_tokens < settled and self.ends[self.sent_tokens] <= len(safe):
            self.sent_tokens += 1
        return (new, self.ids[start:self.sent_tokens],
                self.logprobs[start:self.sent_tokens])

    def rest(self, content: str) -> str:
        """What is left to send of the final ``content`` (it starts with what was sent)."""
        return content[len(self.sent):] if content.startswith(self.sent) else ""


async def live_text(tokens: asyncio.Queue, stream: ReplyStream) -> AsyncIterator[str]:
    """The text of a reply as its tokens arrive (``Batcher.generate``'s queue: ``(choice,
    token, logprob)``, then None), what of it ``stream`` can already send."""
    done = False
    while not done:
        events = [await tokens.get()]
        while not tokens.empty():  # everything sampled meanwhile: one delta
            events.append(tokens.get_nowait())
        done = events[-1] is None
        for _, token, logprob in filter(None, events):
            stream.add(token, logprob)
        text, _, _ = stream.take()
        if text:
            yield text
