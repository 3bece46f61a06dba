"""Tool calls: parse them from a reply, run them concurrently, format their results.

Call formats (``fmt``):

- "hermes" (the fallback, and Qwen's / Hermes' native format): one JSON object per call in
  tags, ``<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>``.
- "llama3-json" (Llama 3.1's native format): a bare JSON object
  ``{"name": "multiply", "parameters": {"a": 3, "b": 4}}``, optionally after
  ``<|python_tag|>``; several may follow each other (separated by ``;`` or whitespace).

Results go back as ``<tool_response>{"name": ..., "content": ...}</tool_response>`` blocks
(``"error"`` instead of ``"content"`` when the call failed). Nothing here raises for what a
model wrote: bad JSON, an unknown tool, a missing or wrong-typed argument, a tool that
raises or overruns its timeout all become a result whose error says what was wrong.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from turnrl.tools.schema import Tool

FORMATS = ("hermes", "llama3-json")

_TAGGED = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it; ``problem`` is "" when it parsed."""

    name: str
    arguments: dict
    raw: str
    problem: str = ""


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str
    error: str = ""
    """"" when the call ran and returned; else one line saying what was wrong"""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error


def render_call(name: str, arguments: dict, fmt: str = "hermes") -> str:
    """One call as a model writes it in ``fmt``: what ``parse_tool_calls`` reads back."""
    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + \
            "\n</tool_call>"
    if fmt == "llama3-json":
        return json.dumps({"name": name, "parameters": arguments})
    raise ValueError(f"unknown tool-call format '{fmt}'; use one of {', '.join(FORMATS)}")


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """Every call in ``text``, in order; a malformed one has ``problem`` set."""
    if fmt == "hermes":
        return [_from_json(m.group(1), closed=bool(m.group(2))) for m in _TAGGED.finditer(text)]
    if fmt == "llama3-json":
        return _bare_json_calls(text.replace("<|python_tag|>", ""))
    raise ValueError(f"unknown tool-call format '{fmt}'; use one of {', '.join(FORMATS)}")


def _from_json(raw: str, closed: bool = True) -> ToolCall:
    raw = raw.strip()
    if not closed:
        return ToolCall("", {}, raw, "the <tool_call> tag is not closed with </tool_call>")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as err:
        return ToolCall("", {}, raw, f"the call is not valid JSON ({err.msg} at character "
                                     f"{err.pos}); write {_EXAMPLE}")
    return _from_object(obj, raw)


_EXAMPLE = '{"name": "<tool name>", "arguments": {"<argument>": <value>}}'


def _from_object(obj, raw: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, raw, f"a call needs a \"name\" string; write {_EXAMPLE}")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI's API sends arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return ToolCall(obj["name"], {}, raw, f"the arguments string is not valid JSON "
                                                  f"({err.msg})")
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], {}, raw, "\"arguments\" must be a JSON object")
    return ToolCall(obj["name"], arguments, raw)


def _bare_json_calls(text: str) -> list[ToolCall]:
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while (start := text.find("{", pos)) != -1:
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as err:
            if text[start:].lstrip("{ \n").startswith('"name"'):  # an attempt that broke
                calls.append(ToolCall("", {}, text[start:], f"the call is not valid JSON "
                                                            f"({err.msg})"))
                break
            pos = start + 1
            continue
        if isinstance(obj, dict) and "name" in obj:
            calls.append(_from_object(obj, text[start:end]))
        pos = end
    return calls


def check_call(call: ToolCall, tools: dict[str, Tool]) -> str:
    """"" when ``call`` parsed, names a known tool and fits its arguments; else why not."""
    if call.problem:
        return call.problem
    if call.name not in tools:
        return f"unknown tool '{call.name}'; available: {', '.join(tools) or 'none'}"
    return tools[call.name].check_arguments(call.arguments)


def as_tool_dict(tools: Iterable[Tool] | dict[str, Tool]) -> dict[str, Tool]:
    if isinstance(tools, dict):
        return tools
    named = {}
    for t in tools:
        if not isinstance(t, Tool):
            raise TypeError(f"{t!r} is not a tool; decorate the function with @tool")
        if t.name in named:
            raise ValueError(f"two tools are named '{t.name}'; pass tool(fn, name=...) to one")
        named[t.name] = t
    return named


async def run_tool_calls(calls: list[ToolCall], tools: Iterable[Tool] | dict[str, Tool],
                         timeout_s: float = 10.0) -> list[ToolResult]:
    """Run every call at once (sync tools on threads), each under ``timeout_s``."""
    named = as_tool_dict(tools)
    return list(await asyncio.gather(*(_run_one(c, named, timeout_s) for c in calls)))


async def _run_one(call: ToolCall, tools: dict[str, Tool], timeout_s: float) -> ToolResult:
    if problem := check_call(call, tools):
        return ToolResult(call.name, "", problem)
    tool = tools[call.name]
    start = time.monotonic()
    try:
        if tool.is_async:
            value = await asyncio.wait_for(tool.fn(**call.arguments), timeout_s)
        else:  # a thread: a slow sync tool must not hold up the other calls (it cannot be
            # killed either: put code that may not return in the sandbox)
            value = await asyncio.wait_for(asyncio.to_thread(tool.fn, **call.arguments),
                                           timeout_s)
    except TimeoutError:
        return ToolResult(call.name, "", f"{call.name} timed out after {timeout_s:g} s",
                          time.monotonic() - start)
    except Exception as err:  # noqa: BLE001 - a tool's failure is the model's observation
        return ToolResult(call.name, "", f"{call.name} raised {type(err).__name__}: {err}",
                          time.monotonic() - start)
    return ToolResult(call.name, _as_text(value), "", time.monotonic() - start)


def _as_text(value) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def format_tool_results(results: list[ToolResult]) -> str:
    """The observation: one ``<tool_response>`` block per call, in call order."""
    blocks = []
    for r in results:
        body = {"name": r.name, "error": r.error} if r.error else {"name": r.name,
                                                                   "content": r.content}
        blocks.append(f"<tool_response>\n{json.dumps(body, ensure_ascii=False)}\n"
                      f"</tool_response>")
    return "\n".join(blocks)


def fallback_system_prompt(tools: Iterable[Tool] | dict[str, Tool], instructions: str = "") -> str:
    """A system prompt that teaches the fallback ("hermes") format, for templates without
    tool support; ``instructions`` (the task's own) come first."""
    named = as_tool_dict(tools)
    schemas = "\n".join(json.dumps(t.schema(), ensure_ascii=False) for t in named.values())
    example = next(iter(named.values()), None)
    # .get: a schema from outside (a demonstration's, an MCP server's) may omit either
    properties = example.parameters.get("properties") or {} if example else {}
    args = {k: _placeholder(properties.get(k) or {})
            for k in example.parameters.get("required") or ()} if example else {}
    call = json.dumps({"name": example.name if example else "tool", "arguments": args})
    head = f"{instructions.strip()}\n\n" if instructions.strip() else ""
    return (f"{head}You can call these tools (JSON schemas):\n<tools>\n{schemas}\n</tools>\n"
            f"To call a tool, write its name and arguments as JSON inside tags:\n"
            f"<tool_call>\n{call}\n</tool_call>\n"
            f"Results come back inside <tool_response></tool_response> tags.")


def _placeholder(schema: dict):
    kind = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    return {"integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}.get(
        kind, "...")
