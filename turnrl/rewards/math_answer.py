"""Math answers checked for equivalence with ``math-verify`` (extra: ``pip install 'turnrl[tools]'``).

``math_answer`` parses the reply (a \\boxed{} answer first, then LaTeX and plain
expressions; units such as ``\\text{ cm}`` are stripped) and the reference, and compares them
symbolically: ``1/2``, ``0.5``, ``\\frac{1}{2}`` and ``\\boxed{\\dfrac{1}{2}}`` are equal;
``0.333`` and ``1/3`` are not (no rounding tolerance beyond math-verify's own).

math-verify bounds parsing and comparison with ``signal.alarm``, which works on the main
thread only; elsewhere (an environment on its own thread, as TurnRL's turn loop runs them)
the bound is off, so a pathological expression could take long: the env step's own timeout
(``rollout.env_timeout_s``) still ends the episode.
"""

from __future__ import annotations

import logging
import threading


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ImportError("math rewards need math-verify: pip install 'turnrl[tools]' "
                          "(or pip install math-verify)") from None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the no-timeout warning
    return math_verify


def _bound(timeout_s: int) -> int | None:
    """math-verify's time bound: ``signal.alarm`` works on the main thread only."""
    return timeout_s if threading.current_thread() is threading.main_thread() else None


def parse_reference(answer: str | int | float, timeout_s: int = 5) -> list:
    """``answer`` as math-verify parses it (as written, else between ``$`` signs: a bare LaTeX
    reference such as \\sqrt{8} needs them); ValueError naming it when neither parses. The
    dataset env calls it on every reference at load, so a bad one fails before training."""
    mv, bound = _math_verify(), _bound(timeout_s)
    gold = mv.parse(str(answer), parsing_timeout=bound)
    if not gold:
        gold = mv.parse(f"${answer}$", parsing_timeout=bound)
    if not gold:
        raise ValueError(f"math_answer: the reference answer {answer!r} does not parse; "
                         f"write it as a number or LaTeX")
    return gold


def math_answer(completion: str, answer: str | int | float, timeout_s: int = 5) -> float | None:
    """1.0 when the reply's final answer equals ``answer`` mathematically, 0.0 when it is a
    different answer, None when no answer can be found in the reply (e.g. only words)."""
    mv, bound = _math_verify(), _bound(timeout_s)
    gold = parse_reference(answer, timeout_s)
    predicted = mv.parse(completion, parsing_timeout=bound)
    if not predicted:
        return None
    return 1.0 if mv.verify(gold, predicted, timeout_seconds=bound) else 0.0
