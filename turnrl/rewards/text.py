"""Rewards read off the reply's text: integers, exact and numeric answers, format, tool use."""

from __future__ import annotations

import math
import re

from turnrl.tools.calls import as_tool_dict, check_call, parse_tool_calls

_INTEGER = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def first_integer(text: str) -> int | None:
    """The first integer written in ``text``, or None."""
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


def last_integer(text: str) -> int | None:
    """The last integer written in ``text``, or None."""
    matches = _INTEGER.findall(text)
    return int(matches[-1]) if matches else None


def integer_match(text: str, answer: int, which: str = "last") -> float:
    """1.0 when the chosen integer of ``text`` equals ``answer``, else 0.0.

    ``which``: "first", "last", or "only" (the reply must be just the number).
    """
    if which == "only":
        stripped = text.strip().rstrip(".")
        value = int(stripped) if re.fullmatch(r"-?\d+", stripped) else None
    elif which in ("first", "last"):
        value = first_integer(text) if which == "first" else last_integer(text)
    else:
        raise ValueError(f"unknown integer parse '{which}'; use first, last or only")
    return 1.0 if value == answer else 0.0


def final_answer(text: str) -> str | None:
    """The reply's final answer: the last ``\\boxed{...}``, else the last ``<answer>...</answer>``,
    else what follows the last "answer:" / "answer is"; None when there is none."""
    for pattern in (_BOXED, _ANSWER_TAG):
        if found := pattern.findall(text):
            return found[-1].strip()
    marker = list(re.finditer(r"answer(?:\s+is)?\s*[:=]?\s*", text, re.IGNORECASE))
    if marker:
        rest = text[marker[-1].end():].strip().splitlines()
        return rest[0].strip().rstrip(".") if rest else None
    return None


def exact_match(completion: str, answer: str) -> float | None:
    """1.0 when the final answer (see ``final_answer``) equals ``answer`` after trimming
    whitespace and case; 0.0 when it differs; None when the reply states no final answer."""
    found = final_answer(completion)
    if found is None:
        return None
    return 1.0 if " ".join(found.split()).lower() == " ".join(str(answer).split()).lower() \
        else 0.0


def numeric_match(completion: str, answer: float, rel_tol: float = 1e-6,
                  abs_tol: float = 1e-9) -> float | None:
    """1.0 when the final answer's number (else the reply's last number; "1,234" reads as
    1234) is within tolerance of ``answer``, 0.0 when not, None when there is no number."""
    found = final_answer(completion)
    numbers = _NUMBER.findall(found if found is not None else completion)
    if not numbers:
        return None
    value = float(numbers[-1].replace(",", ""))
    return 1.0 if math.isclose(value, float(answer), rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


def format_reward(completion: str, pattern: str = r"(?s).*\\boxed\{.+\}.*") -> float:
    """1.0 when the whole reply matches ``pattern`` (default: it contains a \\boxed{} answer),
    else 0.0. Pass e.g. ``r"(?s)<think>.*</think>\\s*<answer>.*</answer>\\s*"``."""
    return 1.0 if re.fullmatch(pattern, completion) else 0.0


def tool_call_bonus(completion: str, tools: dict | list, bonus: float = 0.1,
                    fmt: str = "hermes") -> float:
    """Shaping for tool use: ``bonus`` when the reply makes at least one tool call and every
    call in it is well-formed (valid JSON, a known tool, arguments of the right names and
    types), ``-bonus`` when any call is malformed, 0.0 when there is no call.

    Small on purpose (the task reward should dominate): it teaches the call format early
    without paying for calls that do not help. Tie it to the episode (e.g. give it once,
    not per call), or a policy can farm it with pointless calls.
    """
    calls = parse_tool_calls(completion, fmt)
    if not calls:
        return 0.0
    named = as_tool_dict(tools)
    return -bonus if any(check_call(c, named) for c in calls) else bonus
