"""Refuse env text that cannot fit the context before rendering or tokenising it.

The turn loop's context check counts tokens, so it runs after the chat template rendered the
env's text and the tokenizer encoded it: for a multi-megabyte observation that is gigabytes
of memory and tens of seconds, spent on text that is then thrown away. A character count is
free, and it bounds the token count from below: no token of a tokenizer covers more
characters than its longest vocabulary entry, so ``n`` characters take at least
``n / max_chars_per_token`` tokens. Text longer than ``room * max_chars_per_token``
(``room``: the tokens left in the context after the episode so far and a whole reply) is
certain to overflow; the episode ends there, as the context check would have ended it
(status ``truncated``), with ``end_reason`` ``input_too_large`` and the sizes in its reason.

Why the vocabulary's longest entry is an upper bound: byte-level BPE vocabularies (GPT-2,
Llama 3, Qwen, SmolLM) spell each token one character per byte, and a UTF-8 character is
at least one byte; SentencePiece spells a token with its characters (``▁`` for a space,
``<0xNN>`` for a fallback byte, six characters for one). Special tokens are longer than
any text they match. It does not hold for a tokenizer whose normaliser deletes text
(collapsing runs of spaces, as T5's does) or that maps a whole unknown word to one token
(WordPiece's ``[UNK]``): none of the chat models TurnRL trains has either.

The cost: one pass over the vocabulary per tokenizer (cached), and text up to the bound is
still rendered and tokenised before the exact check.
"""

from __future__ import annotations

import weakref
from typing import Any

from turnrl.safe_json import cut

_CHARS_PER_TOKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_chars_per_token(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` can stand for (its longest vocabulary
    entry, at least 1); computed once per tokenizer."""
    known = _CHARS_PER_TOKEN.get(tokenizer)
    if known is None:
        known = max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))
        _CHARS_PER_TOKEN[tokenizer] = known
    return known


def text_chars(texts: list[Any]) -> int:
    """Characters of ``texts`` that a chat template keeps (it may strip the ends of each)."""
    return sum(len(text.strip()) if isinstance(text, str) else 0 for text in texts)


def too_large(texts: list[Any], room_tokens: int, chars_per_token: int, what: str) -> str | None:
    """A one-line reason when ``texts`` are certain not to fit ``room_tokens``; else None."""
    chars = text_chars(texts)
    limit = max(0, room_tokens) * chars_per_token
    if chars <= limit:
        return None
    return (f"input too large: {what} of {chars:,} chars cannot fit the {max(0, room_tokens):,} "
            f"tokens left in the context (at most {chars_per_token} chars a token: "
            f"{limit:,} chars); shorten it or raise the model's context")


class InputBound:
    """The checks of one turn loop: its tokenizer, context and reply length."""

    def __init__(self, chat: Any, max_context: int | None, max_new_tokens: int) -> None:
        self.chat, self.max_context, self.max_new_tokens = chat, max_context, max_new_tokens

    def reason(self, tokens: int, texts: list[Any], what: str) -> str | None:
        """Why ``texts`` cannot fit after ``tokens`` tokens and a whole reply; None when they
        might (or the context is unknown)."""
        if not self.max_context:
            return None
        room = self.max_context - tokens - self.max_new_tokens
        return too_large(texts, room, max_chars_per_token(self.chat.tokenizer), what)

    def start_refused(self, first: str, system_prompt: str | None) -> str | None:
        """Why the first prompt with the system prompt (the env's, else the chat's) cannot
        fit; None when they might."""
        return self.reason(0, [first, system_prompt or self.chat.system_prompt],
                           "the first prompt and system prompt")

    def step_refused(self, episode: Any, error: BaseException | None, result: Any,
                     tools: list | None) -> tuple[str | None, str | None]:
        """(why the env's reply cannot fit or None, a preview of its observation to store
        instead of one too large to keep or None), before either is stored or rendered:
        what the template would render of it, its tool results where it renders those, else
        the observation. (None, None) for a step that failed."""
        if error is not None:
            return None, None
        tokens = len(episode.token_ids)
        results = (result.info or {}).get("tool_results")
        rendered = ([r.get("content", r.get("error")) for r in results]
                    if results and tools is not None and self.chat.tool_role
                    else [result.observation])
        reason = self.reason(tokens, rendered, "the env's reply")
        too_long = self.reason(tokens, [result.observation], "") is not None
        return reason, cut(result.observation) if too_long else None
