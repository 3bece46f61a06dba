"""Verifiable reward functions: plain functions of the reply text returning ``float | None``.

``None`` means "cannot be judged" (for example no answer found) where a caller wants to
tell that apart from a wrong answer; the built-in tasks treat it as 0. ``combine`` makes a
weighted sum. Math equivalence needs the ``tools`` extra (math-verify); code tests run in
``turnrl.sandbox``. docs/tools.md lists every function and what it returns when.
"""

from turnrl.rewards.code import code_tests, code_tests_async, extract_code
from turnrl.rewards.combine import combine
from turnrl.rewards.math_answer import math_answer
from turnrl.rewards.text import (
    exact_match,
    final_answer,
    first_integer,
    format_reward,
    integer_match,
    last_integer,
    numeric_match,
    tool_call_bonus,
)

__all__ = ["code_tests", "code_tests_async", "combine", "exact_match", "extract_code",
           "final_answer", "first_integer", "format_reward", "integer_match", "last_integer",
           "math_answer", "numeric_match", "tool_call_bonus"]
