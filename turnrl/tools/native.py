"""The model's own tool format: render ``tools=`` with its chat template where it can.

Support is detected, not assumed: a template supports tools when rendering a conversation
with a probe tool differs from rendering it without one and shows the tool's name (templates
without tool support ignore the keyword, SmolLM2's among them). The call format is read off
the rendered prompt: ``<tool_call>`` (Qwen, Hermes) -> "hermes"; a JSON object with
"parameters" (Llama 3.1) -> "llama3-json". Anything else falls back to the documented
"hermes" format taught by ``fallback_system_prompt``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from turnrl.tools.calls import as_tool_dict, fallback_system_prompt
from turnrl.tools.schema import Tool, make_tool

_PROBE_NAME = "turnrl_probe_tool"


def _probe_tool(city: str) -> str:
    """Look up the weather.

    Args:
        city: the city's name
    """
    return city


_PROBE = make_tool(_probe_tool, name=_PROBE_NAME)


def _render(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot take tools does not support them
        return None


def native_tool_format(tokenizer: Any) -> str | None:
    """"hermes" or "llama3-json" when the tokenizer's template renders tools in a call
    format parsed here; None when it has no tool support (use the fallback)."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with_tools = _render(tokenizer, messages, [_PROBE.schema()])
    without = _render(tokenizer, messages, None)
    if not with_tools or with_tools == without or _PROBE_NAME not in with_tools:
        return None
    if "<tool_call>" in with_tools:
        return "hermes"
    if '"parameters"' in with_tools:
        return "llama3-json"
    return None


def render_prompt(tokenizer: Any, messages: list[dict], tools: Iterable[Tool] | dict[str, Tool],
                  ) -> tuple[str, str]:
    """(prompt text, call format): the template's own tool rendering where supported, else
    the fallback system prompt merged into the first system message (or a new one)."""
    named = as_tool_dict(tools)
    fmt = native_tool_format(tokenizer)
    if fmt is not None:
        schemas = [t.schema() for t in named.values()]
        return tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False,
                                             add_generation_prompt=True), fmt
    messages = [dict(m) for m in messages]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = fallback_system_prompt(named, messages[0]["content"])
    else:
        messages.insert(0, {"role": "system", "content": fallback_system_prompt(named)})
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=True), "hermes"
