"""Tools: schema from signatures and docstrings, call parsing, running, native templates."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal, Optional

import pytest

from turnrl.models import tiny_tokenizer
from turnrl.sandbox import Limits, Sandbox
from turnrl.tools import (
    fallback_system_prompt,
    format_tool_results,
    make_tool,
    native_tool_format,
    parse_tool_calls,
    python_tool,
    render_prompt,
    run_tool_calls,
    tool,
)


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a (int): the first factor
        b: the second factor,
            on two lines
    """
    return a * b


@tool(name="lookup")
async def find(word: str, lang: Literal["en", "fr"] = "en", limit: Optional[int] = None,  # noqa: UP045
               tags: list[str] | None = None, scale: float = 1.0, exact: bool = False) -> dict:
    """Look a word up.

    Longer text that is not the description.
    """
    await asyncio.sleep(0)
    return {"word": word, "lang": lang}


def run(calls, tools, timeout_s=5.0):
    return asyncio.run(run_tool_calls(calls, tools, timeout_s))


def test_schema_from_signature_and_google_docstring():
    assert multiply.schema() == {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "description": "the first factor"},
            "b": {"type": "integer", "description": "the second factor, on two lines"}}}}}


def test_schema_of_literal_optional_list_defaults_and_async():
    fn = find.schema()["function"]
    assert fn["name"] == "lookup" and fn["description"] == "Look a word up."
    assert find.is_async and not multiply.is_async
    props = fn["parameters"]["properties"]
    assert props["lang"] == {"type": "string", "enum": ["en", "fr"], "default": "en"}
    assert props["limit"] == {"type": "integer", "nullable": True}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "nullable": True}
    assert props["scale"] == {"type": "number", "default": 1.0}
    assert props["exact"] == {"type": "boolean", "default": False}
    assert fn["parameters"]["required"] == ["word"]


def test_numpy_docstring():
    def area(width: float, height: float) -> float:
        """Area of a rectangle.

        Parameters
        ----------
        width : float
            the width,
            in metres
        height : float
            the height
        """
        return width * height

    props = make_tool(area).parameters["properties"]
    assert props["width"]["description"] == "the width, in metres"
    assert props["height"]["description"] == "the height"


def test_undescribable_functions_fail_with_the_fix():
    def untyped(x):
        return x

    def star(*args: int):
        return args

    def odd(x: complex):
        return x

    with pytest.raises(TypeError, match="parameter 'x' needs a type hint"):
        make_tool(untyped)
    with pytest.raises(TypeError, match=r"\*args/\*\*kwargs"):
        make_tool(star)
    with pytest.raises(TypeError, match="has no JSON schema; use str, int"):
        make_tool(odd)


def test_well_formed_calls_run_sync_and_async():
    text = ('Let me compute. <tool_call>\n{"name": "multiply", "arguments": {"a": 123, '
            '"b": 456}}\n</tool_call> and <tool_call>{"name": "lookup", "arguments": '
            '"{\\"word\\": \\"chat\\", \\"lang\\": \\"fr\\"}"}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.problem) for c in calls] == [
        ("multiply", {"a": 123, "b": 456}, ""), ("lookup", {"word": "chat", "lang": "fr"}, "")]
    results = run(calls, [multiply, find])
    assert [r.content for r in results] == ["56088", '{"word": "chat", "lang": "fr"}']
    assert all(r.ok for r in results)


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "multiply", "arguments": {"a": 1 "b": 2}}</tool_call>',
     "not valid JSON (Expecting ',' delimiter at character"),
    ('<tool_call>{"name": "multiply", "arguments": {"a": 1, "b": 2}}', "tag is not closed"),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', 'a call needs a "name" string'),
    ('<tool_call>["multiply", 1, 2]</tool_call>', 'a call needs a "name" string'),
    ('<tool_call>{"name": "multiply", "arguments": [1, 2]}</tool_call>',
     '"arguments" must be a JSON object'),
    ('<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call>',
     "unknown tool 'divide'; available: multiply, lookup"),
    ('<tool_call>{"name": "multiply", "arguments": {"a": 1}}</tool_call>',
     "missing argument b (multiply(a: integer, b: integer))"),
    ('<tool_call>{"name": "multiply", "arguments": {"a": "12", "b": 2}}</tool_call>',
     "argument 'a' must be an integer, got string '12'"),
    ('<tool_call>{"name": "multiply", "arguments": {"a": 1, "b": 2, "c": 3}}</tool_call>',
     "unknown argument c; multiply takes a, b"),
    ('<tool_call>{"name": "lookup", "arguments": {"word": "x", "lang": "de"}}</tool_call>',
     "argument 'lang' must be one of 'en' | 'fr', got 'de'"),
    ('<tool_call>{"name": "lookup", "arguments": {"word": "x", "tags": ["a", 2]}}</tool_call>',
     "argument 'tags' item 1 must be a string, got integer 2"),
])
def test_malformed_calls_become_error_observations(text, error):
    results = run(parse_tool_calls(text), [multiply, find])
    assert len(results) == 1 and not results[0].ok
    assert error in results[0].error
    observation = json.loads(format_tool_results(results).split("\n")[1])
    assert error in observation["error"]  # what the model reads


def test_a_raising_or_slow_tool_is_an_error_and_calls_run_concurrently():
    spans: dict[str, list[float]] = {"slow": [], "blocking": []}

    @tool
    async def slow(seconds: float) -> str:
        """Sleep."""
        started = time.monotonic()
        await asyncio.sleep(seconds)
        spans["slow"].append(started)
        spans["slow"].append(time.monotonic())
        return "done"

    @tool
    def blocking(seconds: float) -> str:
        """Block a thread."""
        started = time.monotonic()
        time.sleep(seconds)
        spans["blocking"] += [started, time.monotonic()]
        return "done"

    @tool
    def broken(x: int) -> int:
        """Fail."""
        raise ValueError("no good")

    text = "".join(f'<tool_call>{{"name": "{n}", "arguments": {a}}}</tool_call>' for n, a in [
        ("slow", '{"seconds": 0.4}'), ("blocking", '{"seconds": 0.4}'),
        ("slow", '{"seconds": 30}'), ("broken", '{"x": 1}')])
    started = time.monotonic()
    # 0.4 s calls under a 3 s limit: answered on a busy machine too (0.8 s left them 0.4 s
    # of slack); the 30 s one is cut
    results = run(parse_tool_calls(text), [slow, blocking, broken], timeout_s=3.0)
    assert time.monotonic() - started < 20  # the 30 s one was cut (at 3 s, below)
    assert [r.content for r in results[:2]] == ["done", "done"]
    # together: the blocking call ran while the async one slept (a busy machine may delay
    # either; one after the other they could not overlap)
    (s_start, s_end), (b_start, b_end) = spans["slow"][:2], spans["blocking"]
    assert b_start < s_end and s_start < b_end
    assert results[2].error == "slow timed out after 3 s"
    assert results[3].error == "broken raised ValueError: no good"


def test_llama3_json_calls():
    text = ('<|python_tag|>{"name": "multiply", "parameters": {"a": 2, "b": 3}}; '
            '{"name": "multiply", "parameters": {"a": 4, "b": 5}}')
    results = run(parse_tool_calls(text, "llama3-json"), [multiply])
    assert [r.content for r in results] == ["6", "20"]
    broken = parse_tool_calls('{"name": "multiply", "parameters": {"a": 2,', "llama3-json")
    assert len(broken) == 1 and "not valid JSON" in broken[0].problem
    assert parse_tool_calls("The answer is 6 {not a call}", "llama3-json") == []
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        parse_tool_calls("", "xml")


def test_the_fallback_prompt_example_is_a_valid_call():
    prompt = fallback_system_prompt([multiply], "Answer the question.")
    assert prompt.startswith("Answer the question.") and '"name": "multiply"' in prompt
    example = prompt[prompt.index("<tool_call>"):prompt.index("</tool_call>") + 12]
    assert run(parse_tool_calls(example), [multiply])[0].content == "1"


HERMES_STYLE = (
    "{% if tools %}<|im_start|>system\nYou may call functions:\n<tools>\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}</tools>\nReply with <tool_call>\n{\"name\": <name>, "
    "\"arguments\": <object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_STYLE = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if loop.first and tools %}Respond with a JSON object {\"name\": function name, "
    "\"parameters\": dictionary of arguments}.\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}{% endif %}{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def _tokenizer(template: str | None):
    tok = tiny_tokenizer()
    if template:
        tok.chat_template = template
    return tok


@pytest.mark.parametrize("template, fmt", [(None, None), (HERMES_STYLE, "hermes"),
                                           (LLAMA_STYLE, "llama3-json")])
def test_native_tool_support_is_detected_from_the_template(template, fmt):
    tok = _tokenizer(template)
    assert native_tool_format(tok) == fmt
    messages = [{"role": "user", "content": "What is 12 times 34?"}]
    prompt, used = render_prompt(tok, messages, [multiply])
    assert used == (fmt or "hermes")
    assert '"name": "multiply"' in prompt and prompt.count("What is 12 times 34?") == 1
    if fmt is None:  # ChatML without tool support (as SmolLM2's): the fallback system prompt
        assert prompt.startswith("<|im_start|>system\nYou can call these tools")


def test_python_tool_runs_code_in_the_sandbox():
    # a wall clock far above the CPU limit: on a loaded machine the loop gets a fraction of a
    # core, and it is the CPU limit this test is about
    py = python_tool(Sandbox("fallback", Limits(wall_s=40.0, cpu_s=1.0)))
    assert py.name == "python" and py.parameters["required"] == ["code"]
    text = "".join(f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": c}})}'
                   f'</tool_call>' for c in ["print(123 * 456)", "1/0", "while True: pass", ""])
    results = run(parse_tool_calls(text), [py], timeout_s=60.0)
    assert results[0].content == "56088\n"
    assert "ZeroDivisionError" in results[1].error and not results[1].content
    assert "[timeout] CPU-time limit of 1 s reached" in results[2].error
    assert results[3].content == "(the program printed nothing)"
