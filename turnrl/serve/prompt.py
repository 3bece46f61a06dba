"""OpenAI messages and tools -> the chat template's text; the model's reply -> content and
``tool_calls``.

Tools use the format of "Agents with tools" (docs/tools.md): the template's own where it
renders tools (``ChatFormat.native_tools``), else the fallback system prompt that teaches
``<tool_call>{json}</tool_call>``. A served reply goes back to the client as ``content``
plus ``tool_calls``; when the agent sends that assistant message back in its next call, the
server renders the text the model actually wrote (``ReplyMemory``), not a re-serialisation of
the calls, so the next prompt extends the previous one token for token and the calls of an
episode merge into one multi-turn sequence.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import OrderedDict

from turnrl.rollout import ChatFormat
from turnrl.tools.calls import fallback_system_prompt, parse_tool_calls
from turnrl.tools.schema import Tool

_CALL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


class ReplyMemory:
    """The raw text behind each served reply, keyed by what the client sees of it: its tool
    call ids, or its content when it made no call. Bounded; oldest forgotten first."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._raw: OrderedDict[tuple, str] = OrderedDict()

    @staticmethod
    def key(content: str | None, tool_calls: list[dict] | None) -> tuple:
        if tool_calls:
            return ("calls",) + tuple(c["id"] for c in tool_calls)
        return ("text", content or "")

    def remember(self, content: str | None, tool_calls: list[dict], raw: str) -> None:
        key = self.key(content, tool_calls)
        self._raw.pop(key, None)
        self._raw[key] = raw
        while len(self._raw) > self.size:
            self._raw.popitem(last=False)

    def raw(self, message: dict) -> str | None:
        return self._raw.get(self.key(message.get("content"), message.get("tool_calls")))


def _schema_tool(schema: dict) -> Tool:
    """A ``Tool`` holding a client's schema, for the fallback prompt (never called here)."""
    fn = schema["function"]
    params = dict(fn.get("parameters") or {})
    params.setdefault("properties", {})
    params.setdefault("required", [])
    return Tool(fn["name"], fn.get("description", ""), params, fn=lambda **_: None)


def _written_calls(calls: list[dict]) -> str:
    """Calls the server did not serve (an agent's own few-shot history), in the fallback
    format."""
    blocks = []
    for call in calls:
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            arguments = call["function"]["arguments"]
        blocks.append("<tool_call>\n" + json.dumps({"name": call["function"]["name"],
                                                    "arguments": arguments}) + "\n</tool_call>")
    return "\n".join(blocks)


def template_messages(messages: list[dict], chat: ChatFormat, memory: ReplyMemory,
                      tools: list[dict] | None) -> list[dict]:
    """Checked OpenAI messages as the template takes them: served replies as the model wrote
    them; tool results as ``tool`` messages where the template has that role, else one user
    message of ``<tool_response>`` blocks (the fallback format); the fallback tool prompt
    merged into the system message when the template renders no tools."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", [])}
    out: list[dict] = []
    for message in messages:
        role = message["role"]
        if role == "assistant":
            raw = memory.raw(message)
            if raw is None:
                raw = "\n".join(filter(None, [message.get("content") or "",
                                              _written_calls(message.get("tool_calls", []))]))
            out.append({"role": "assistant", "content": raw})
        elif role == "tool":
            name = message.get("name") or names.get(message.get("tool_call_id"), "tool")
            if chat.tool_role and tools:
                out.append({"role": "tool", "name": name, "content": message["content"]})
                continue
            block = ("<tool_response>\n" + json.dumps({"name": name,
                                                       "content": message["content"]},
                                                      ensure_ascii=False) + "\n</tool_response>")
            if out and out[-1].get("tool_block"):  # one user turn for a reply's results
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_block": True})
        else:
            out.append({"role": role, "content": message["content"]})
    for message in out:
        message.pop("tool_block", None)
    if tools and chat.native_tools is None:
        prompt = fallback_system_prompt([_schema_tool(t) for t in tools],
                                        out[0]["content"] if out[0]["role"] == "system" else "")
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render(chat: ChatFormat, messages: list[dict], memory: ReplyMemory,
           tools: list[dict] | None) -> str:
    """The prompt text, generation prompt included; ``tools`` None when tool_choice is none."""
    msgs = template_messages(messages, chat, memory, tools)
    native = tools if tools and chat.native_tools is not None else None
    return chat.render(msgs, True, native)


def call_format(chat: ChatFormat) -> str:
    return chat.native_tools or "hermes"


def split_reply(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool_calls) of a reply; malformed calls stay in the content, as text
    the agent can see (the same rule as the turn loop: never an exception)."""
    calls = [c for c in parse_tool_calls(text, fmt) if not c.problem]
    if not calls:
        return text, []
    tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                   "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                  for c in calls]
    if fmt == "hermes":  # trailing space only: a stream has sent the content before a call
        content = _CALL_BLOCK.sub("", text).rstrip()
    else:  # a bare-JSON format: the calls are the reply
        content = ""
    return content or None, tool_calls


def forced_call(fmt: str, tool_choice: str | dict) -> str:
    """The opening of a tool call that ``tool_choice`` forces, written after the generation
    prompt: ``<tool_call>\n{"name": "`` for "required" (the model picks the tool), up to
    the arguments for a named function; "" for "auto" and "none"."""
    if not (tool_choice == "required" or isinstance(tool_choice, dict)):
        return ""
    opening = '{"name": ' if fmt == "llama3-json" else '<tool_call>\n{"name": '
    if tool_choice == "required":
        return opening + '"'
    arguments = "parameters" if fmt == "llama3-json" else "arguments"
    return f'{opening}{json.dumps(tool_choice["function"]["name"])}, "{arguments}": '
