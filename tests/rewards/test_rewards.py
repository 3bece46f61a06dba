"""Reward functions: math equivalence, exact/numeric match, format, code tests, tool use, combine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from turnrl.rewards import (
    code_tests,
    code_tests_async,
    combine,
    exact_match,
    extract_code,
    final_answer,
    format_reward,
    integer_match,
    math_answer,
    numeric_match,
    tool_call_bonus,
)
from turnrl.sandbox import Limits, Sandbox
from turnrl.tools import tool


@pytest.mark.parametrize("reply, answer", [
    ("1/2", "0.5"),
    ("0.5", "1/2"),
    (r"$\frac{1}{2}$", "0.5"),
    (r"The answer is $\boxed{\frac{1}{2}}$.", "1/2"),
    (r"\boxed{\dfrac{3}{4}}", "0.75"),
    (r"So $x = \boxed{42\text{ cm}}$", "42"),
    ("The area is 42 cm", "42"),
    (r"$2\sqrt{2}$", r"\sqrt{8}"),
    (r"\boxed{1,000}", "1000"),
])
def test_math_equivalents_score_one(reply, answer):
    assert math_answer(reply, answer) == 1.0


@pytest.mark.parametrize("reply, answer", [
    ("0.333", "1/3"),  # no rounding tolerance
    (r"\boxed{2}", "1/2"),
    (r"First I get $\frac{1}{2}$ but the final answer is \boxed{3}", "1/2"),  # boxed wins
])
def test_math_different_answers_score_zero(reply, answer):
    assert math_answer(reply, answer) == 0.0


def test_math_reply_without_an_answer_is_none_and_a_bad_reference_raises():
    assert math_answer("I do not know.", "1/2") is None
    with pytest.raises(ValueError, match="reference answer '' does not parse"):
        math_answer("1", "")


def test_math_answer_off_the_main_thread():
    """Env steps run on their own threads, where math-verify's signal timeouts cannot."""
    out = []
    worker = threading.Thread(target=lambda: out.append(math_answer(r"\boxed{0.5}", "1/2")))
    worker.start()
    worker.join()
    assert out == [1.0]


def test_final_answer_exact_and_numeric_match():
    assert final_answer(r"so \boxed{Paris}.") == "Paris"
    assert final_answer("<answer> blue </answer>") == "blue"
    assert final_answer("The answer is: 12.") == "12"
    assert final_answer("no idea") is None
    assert exact_match("Answer: paris", "Paris") == 1.0
    assert exact_match("Answer: Lyon", "Paris") == 0.0
    assert exact_match("Paris, I think", "Paris") is None  # no final answer stated
    assert numeric_match("The answer is 1,234.0", 1234) == 1.0
    assert numeric_match("It is 3.1416", 3.14159, rel_tol=1e-4) == 1.0
    assert numeric_match("It is 3.2", 3.14159, rel_tol=1e-4) == 0.0
    assert numeric_match("Answer: none", 3) is None
    assert integer_match("56088", 56088, which="only") == 1.0  # the existing names stay


def test_format_reward():
    assert format_reward(r"Thinking... \boxed{3}") == 1.0
    assert format_reward("3") == 0.0
    think = r"(?s)<think>.*</think>\s*<answer>.*</answer>\s*"
    assert format_reward("<think>a</think><answer>3</answer>", think) == 1.0
    assert format_reward("<answer>3</answer>", think) == 0.0


SOLUTION = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(1, 1) == 3",
         "assert isinstance(add(1, 2), int)"]
BOX = Sandbox("fallback", Limits(wall_s=2.0, cpu_s=1.0))


def test_code_reward_is_the_fraction_of_tests_passed():
    assert extract_code(SOLUTION).startswith("def add(a, b):")
    assert code_tests(SOLUTION, TESTS, BOX) == 0.75
    assert code_tests("def add(a, b): return a - b", TESTS, BOX) == 0.25  # only isinstance
    assert code_tests("def add(a, b) return", TESTS, BOX) == 0.0  # does not compile
    assert code_tests("def add(a, b):\n    while True: pass", TESTS, BOX) == 0.0  # times out
    assert code_tests(SOLUTION, [], BOX) is None


def test_code_reward_cannot_be_forged_by_printing_results():
    """Equality asserts are judged outside: printing the harness's marker gains nothing."""
    forged = ("import sys\nfor _ in range(10):\n    print('@@turnrl-test@@'"
              " + '{\"passed\": true}')\ndef add(a, b): return 0\n")
    assert code_tests(forged, TESTS[:3], BOX) == 0.0


def test_code_reward_async_inside_an_event_loop():
    async def inside():
        with pytest.raises(RuntimeError, match="use `await code_tests_async"):
            code_tests(SOLUTION, TESTS, BOX)
        return await code_tests_async(SOLUTION, TESTS, BOX)

    assert asyncio.run(inside()) == 0.75


@tool
def multiply(a: int, b: int) -> int:
    """Multiply."""
    return a * b


def test_tool_call_bonus():
    good = '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'
    bad = '<tool_call>{"name": "multiply", "arguments": {"a": "2"}}</tool_call>'
    assert tool_call_bonus(good, [multiply]) == 0.1
    assert tool_call_bonus(good + bad, [multiply], bonus=0.2) == -0.2
    assert tool_call_bonus("The answer is 6.", [multiply]) == 0.0


def test_combine_weights_passes_each_its_facts_and_handles_none():
    reward = combine([(math_answer, 1.0), (format_reward, 0.1)])
    assert reward(r"\boxed{0.5}", answer="1/2") == pytest.approx(1.1)
    assert reward("0.5", answer="1/2") == pytest.approx(1.0)
    assert reward("no idea", answer="1/2") == 0.0  # None + 0.0: the format part judged
    only_none = combine([(exact_match, 1.0)])
    assert only_none("no idea", answer="x") is None
    with pytest.raises(TypeError, match=r"\(function, weight\) pairs"):
        combine([(math_answer, "1")])
    with pytest.raises(ValueError, match="at least one"):
        combine([])


def test_combine_with_an_async_part_is_async():
    async def code(completion, tests):
        return await code_tests_async(completion, tests, BOX)

    reward = combine([(code, 1.0), (format_reward, 0.5)])
    assert asyncio.run(reward(SOLUTION, tests=TESTS, answer="unused")) == 0.75
