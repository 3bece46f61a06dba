"""The OpenAI Responses API (``POST /v1/responses``) on the served policy, recorded as chat
completions are.

A Responses request is translated into the checked ``ChatRequest`` of chat completions and
served by the same ``Server.complete``: the same prompt rendering (served replies as the
model wrote them), the same tool-call parsing, and the same recording of exact token ids into
the episode records (``X-TurnRL-Episode`` header or ``turnrl_episode`` body field), merged
across calls into one multi-turn sequence with its loss mask. So agents written against the
Responses API (Codex-style harnesses, the OpenAI Agents SDK) train through ``train_agent``
unchanged.

Translation of the input items, in order:

- a string: one user message; ``instructions``: a system message first (not carried over by
  ``previous_response_id``, as in OpenAI's API);
- ``message`` items (user, system, developer, assistant) with ``input_text`` /
  ``output_text`` parts: chat messages of those roles;
- ``function_call`` items: tool calls of the assistant message just before (or of a new
  one), their ``call_id`` the call's id, so a call the server made renders as the text the
  model wrote (``prompt.ReplyMemory``); ``function_call_output`` items: tool messages;
- ``reasoning`` items: their text (``content``, else ``summary``) as
  ``<think>...</think>`` at the start of the next assistant turn (the model cannot read
  ``encrypted_content``; a reasoning model's own thinking stays in its message's text).

``previous_response_id`` continues a stored response: its conversation (input and output) is
put before the new input, and its episode id is inherited, so a chained call extends the
same recorded sequence. Responses are stored (``store``, default true) in a bounded memory,
oldest forgotten first; ``GET /v1/responses/{id}`` returns one.

Streaming sends OpenAI's event sequence (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``... ``response.output_item.done``, the function calls'
``response.function_call_arguments.delta/done``, then ``response.completed`` or
``response.incomplete``), the text live as ``ReplyStream`` settles it. A client that leaves
mid-stream costs nothing but its own request: the reply is still generated, recorded whole
and stored.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from turnrl.serve.protocol import (
    EPISODE_FIELD,
    ApiError,
    ChatRequest,
    _number,
    bad,
    check_messages,
    check_tool_choice,
    check_tools,
)
from turnrl.serve.server import Choice, Server
from turnrl.serve.stream import ReplyStream, live_text

TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
UNSUPPORTED = {"background": "background responses", "conversation": "conversations (send "
               "previous_response_id, or the whole input)", "prompt": "stored prompts"}


def item_id(prefix: str) -> str:
    """An id in OpenAI's style: ``resp_...``, ``msg_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass
class ResponsesRequest:
    chat: ChatRequest
    """What ``Server.complete`` serves (the whole conversation as chat messages)."""
    history: list[dict]
    """The conversation without ``instructions`` (what a chained response continues)."""
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    tools: list[dict] = field(default_factory=list)
    """As sent (Responses' shape), echoed in the response."""
    tool_choice: str | dict = "auto"
    max_output_tokens: int | None = None
    metadata: dict = field(default_factory=dict)


@dataclass
class Stored:
    body: dict
    history: list[dict]
    """The conversation, this response's output included, as chat messages."""
    episode: str | None


# ---- request: Responses' shapes -> chat messages and tools (pure) -------------------------


def content_text(content, where: str) -> str:
    """A message's or tool output's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of input_text parts, got "
                  f"{type(content).__name__}", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if kind else None
        if kind not in TEXT_PARTS + ("refusal",) or not isinstance(text, str):
            raise bad(f"{where}[{j}]: only text parts ({{'type': 'input_text', 'text': ...}}) "
                      f"are supported by this text-only model, got {kind!r}", f"{where}[{j}]")
        parts.append(text)
    return "".join(parts)


def reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's readable text: its ``content`` texts, else its ``summary``'s."""
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
            raise bad(f"{where}.{key} must be a list of {{'type', 'text'}} parts", f"{where}.{key}")
        if parts:
            return "\n".join(p["text"] for p in parts)
    return ""


def _function_call(item: dict, where: str) -> dict:
    arguments = item.get("arguments", "")
    if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str) \
            or not isinstance(arguments, str):
        raise bad(f"{where} (function_call) needs string 'call_id', 'name' and 'arguments'",
                  where)
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": arguments}}


def _assistant(out: list[dict], thinking: list[str]) -> dict:
    """The assistant message a function call joins: the last one, else a new one."""
    if out and out[-1]["role"] == "assistant" and not thinking:
        return out[-1]
    out.append({"role": "assistant", "content": _think(thinking) or None})
    return out[-1]


def _think(thinking: list[str]) -> str:
    text = "".join(f"<think>\n{t}\n</think>\n\n" for t in thinking)
    thinking.clear()
    return text


def input_messages(items, where: str = "input") -> list[dict]:
    """Input items (or a string) as chat messages (see the module's docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad(f"'{where}' must be a string or a list of input items", where)
    out: list[dict] = []
    thinking: list[str] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = item.get("type", "message" if "role" in item else None) \
            if isinstance(item, dict) else None
        if kind not in ITEM_TYPES:
            raise bad(f"{at}: items of type {kind!r} are not served; send message, "
                      "function_call, function_call_output or reasoning items", at)
        if thinking and (kind == "function_call_output" or kind == "message"
                         and item.get("role") != "assistant"):
            out.append({"role": "assistant", "content": _think(thinking)})  # nothing followed
        if kind == "reasoning":
            if text := reasoning_text(item, at):
                thinking.append(text)
        elif kind == "function_call":
            _assistant(out, thinking).setdefault("tool_calls", []).append(
                _function_call(item, at))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or "output" not in item:
                raise bad(f"{at} (function_call_output) needs 'call_id' and 'output'", at)
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": content_text(item["output"], f"{at}.output")})
        else:
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{at}.role must be user, system, developer or assistant, got "
                          f"{role!r}", f"{at}.role")
            text = content_text(item.get("content"), f"{at}.content")
            out.append({"role": role, "content": (_think(thinking) if role == "assistant"
                                                  else "") + text})
    if thinking:  # reasoning with nothing after it: an assistant turn of its own
        out.append({"role": "assistant", "content": _think(thinking)})
    return out


def chat_tools(tools) -> list[dict] | None:
    """Responses' function tools (``{"type": "function", "name", "parameters"}``) in chat's
    shape; hosted tools (web search, files, ...) are a 400."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of {'type': 'function', 'name', 'parameters'}",
                  "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function" or not isinstance(tool.get("name"), str):
            raise bad(f"tools[{i}]: only function tools ({{'type': 'function', 'name', "
                      f"'parameters'}}) are served, got {kind!r}", f"tools[{i}]")
        parameters, description = tool.get("parameters"), tool.get("description")
        if not isinstance(parameters, dict | None) or not isinstance(description, str | None):
            raise bad(f"tools[{i}]: 'parameters' must be a JSON schema object and "
                      "'description' a string", f"tools[{i}]")
        out.append({"type": "function", "function": {
            "name": tool["name"], "description": description or "",
            "parameters": parameters or {"type": "object", "properties": {}}}})
    return check_tools(out)


def chat_tool_choice(choice, tools: list[dict] | None) -> str | dict:
    """"none", "auto", "required" or ``{"type": "function", "name": N}`` in chat's shape."""
    if choice is None:
        return "auto"
    named = isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("name"), str)
    if not (named or choice in ("none", "auto", "required")):
        raise bad("'tool_choice' must be none, auto, required or {'type': 'function', "
                  "'name': ...}", "tool_choice")
    return check_tool_choice({"type": "function", "function": {"name": choice["name"]}}
                             if named else choice, tools)


def _check_options(body: dict) -> None:
    """Fields this server refuses (they would change the reply in a way it cannot serve)."""
    for name, what in UNSUPPORTED.items():
        if body.get(name):
            raise bad(f"'{name}': {what} are not supported by turnrl serve", name)
    text = body.get("text")
    fmt = (text.get("format") or {}) if isinstance(text, dict) else None
    if text is not None and not isinstance(fmt, dict):
        raise bad("'text' must be an object such as {'format': {'type': 'text'}}", "text")
    if fmt and fmt.get("type", "text") != "text":
        raise bad(f"'text.format' {fmt.get('type')!r}: only plain text is served (no "
                  "structured outputs); drop text.format", "text.format")


def parse_responses_request(body, episode_header: str | None,
                            stored: dict[str, Stored]) -> ResponsesRequest:
    """Check a /v1/responses body; raise ``ApiError`` (400, 404 for an unknown
    ``previous_response_id``) naming what is wrong."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise bad("'model' is required (see GET /v1/models)", "model")
    _check_options(body)
    previous_id, before = body.get("previous_response_id"), None
    if previous_id is not None:
        if not isinstance(previous_id, str):
            raise bad("'previous_response_id' must be a string (a response's id)",
                      "previous_response_id")
        if previous_id not in stored:
            raise ApiError(404, f"Previous response with id {previous_id!r} not found (never "
                           "stored, forgotten, or sent with store=false)",
                           param="previous_response_id", code="previous_response_not_found")
        before = stored[previous_id]
    if body.get("input") is None and before is None:
        raise bad("'input' is required: a string or a list of input items", "input")
    history = (before.history if before else []) + input_messages(
        body["input"] if body.get("input") is not None else [])
    instructions = body.get("instructions")
    if not isinstance(instructions, str | None):
        raise bad("'instructions' must be a string", "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    if not messages:
        raise bad("'input' is empty: send at least one message", "input")
    tools = chat_tools(body.get("tools"))
    max_out = body.get("max_output_tokens")
    max_out = None if max_out is None else int(_number(body, "max_output_tokens", 1, 1,
                                                       1 << 20, True))
    episode = body.get(EPISODE_FIELD) or episode_header or (before.episode if before else None)
    if not isinstance(episode, str | None):
        raise bad(f"'{EPISODE_FIELD}' must be a string (the episode id)", EPISODE_FIELD)
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise bad("'metadata' must be an object of string values", "metadata")
    chat = ChatRequest(model=body["model"], messages=check_messages(messages), tools=tools,
                       tool_choice=chat_tool_choice(body.get("tool_choice"), tools),
                       temperature=float(_number(body, "temperature", 1.0, 0, 2)),
                       top_p=float(_number(body, "top_p", 1.0, 1e-9, 1)),
                       max_tokens=max_out, stream=bool(body.get("stream")),
                       episode=episode or None)
    return ResponsesRequest(chat, history, instructions, previous_id,
                            body.get("store") is not False, body.get("tools") or [],
                            body.get("tool_choice") or "auto", max_out, metadata)


# ---- response: a served choice -> Responses' output items and body (pure) -----------------


def output_items(choice: Choice, message_id: str) -> list[dict]:
    """The reply as output items: a message with its text (when there is text, or no call),
    then one ``function_call`` item per parsed call."""
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    items = []
    if choice.content is not None and (choice.content or not choice.tool_calls):
        items.append({"type": "message", "id": message_id, "status": status,
                      "role": "assistant", "content": [text_part(choice.content)]})
    for call in choice.tool_calls:
        items.append({"type": "function_call", "id": item_id("fc"), "call_id": call["id"],
                       "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_body(request: ResponsesRequest, response_id: str, model: str, created: float,
                  status: str = "in_progress", output: list | None = None,
                  usage: dict | None = None) -> dict:
    """A Response object (``status``: in_progress, completed, incomplete or failed)."""
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "error": None, "model": model, "output": output or [],
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata, "parallel_tool_calls": True,
        "previous_response_id": request.previous_response_id,
        "temperature": request.chat.temperature, "top_p": request.chat.top_p,
        "tool_choice": request.tool_choice, "tools": request.tools, "store": request.store,
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "reasoning": None,
        "usage": usage}


def response_usage(prompt_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def reply_message(choice: Choice) -> dict:
    """The reply as the chat message a chained response's conversation holds."""
    message = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        message["tool_calls"] = choice.tool_calls
    return message


class Events:
    """Server-sent events of one streamed response, numbered in order."""

    def __init__(self):
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> str:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n"


# ---- the API over a Server ------------------------------------------------------------------


class ResponsesApi:
    """``POST /v1/responses`` and ``GET /v1/responses/{id}`` over ``server``; keeps the last
    ``size`` stored responses for ``previous_response_id``."""

    def __init__(self, server: Server, size: int = 4096):
        self.server, self.size = server, size
        self.stored: OrderedDict[str, Stored] = OrderedDict()
        self._replies: set[asyncio.Task] = set()
        """Streamed replies whose client may have gone: held here until generated and kept."""

    def retrieve(self, response_id: str) -> dict:
        if response_id not in self.stored:
            raise ApiError(404, f"no response with id {response_id!r} is stored (never "
                           "created here, forgotten, or sent with store=false)",
                           code="response_not_found")
        return self.stored[response_id].body

    async def create(self, body, episode_header: str | None) -> dict | AsyncIterator[str]:
        """The response (a dict), or its events (streamed); ``ApiError`` on bad input."""
        request = parse_responses_request(body, episode_header, self.stored)
        response_id, message_id, created = item_id("resp"), item_id("msg"), time.time()
        prepared = self._prompt(request.chat)  # bad input fails here, before any stream
        if not request.chat.stream:
            return await self._answer(request, response_id, message_id, created,
                                      prepared=prepared)
        return self._events(request, response_id, message_id, created, prepared)

    def _prompt(self, chat: ChatRequest) -> tuple:
        """``Server.prompt``, its context error in this API's names."""
        try:
            return self.server.prompt(chat)
        except ApiError as err:
            if err.code == "context_length_exceeded":
                err.message = err.message.replace("max_tokens", "max_output_tokens") \
                    .replace("the messages", "the input")
                err.param = "input"
            raise

    async def _answer(self, request: ResponsesRequest, response_id: str, message_id: str,
                      created: float, tokens: asyncio.Queue | None = None,
                      prepared: tuple | None = None) -> dict:
        """Generate (recorded by ``Server.complete``), shape and store one response."""
        choices, prompt_tokens = await self.server.complete(request.chat, tokens, prepared)
        choice = choices[0]
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        body = response_body(request, response_id, self.server.name, created, status,
                             output_items(choice, message_id),
                             response_usage(prompt_tokens, len(choice.token_ids)))
        if request.store:
            self.stored[response_id] = Stored(body, request.history + [reply_message(choice)],
                                              request.chat.episode)
            while len(self.stored) > self.size:
                self.stored.popitem(last=False)
        return body

    async def _events(self, request: ResponsesRequest, response_id: str, message_id: str,
                      created: float, prepared: tuple) -> AsyncIterator[str]:
        event = Events()
        start = response_body(request, response_id, self.server.name, created)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        tokens: asyncio.Queue = asyncio.Queue()
        reply = asyncio.create_task(self._answer(request, response_id, message_id, created,
                                                 tokens, prepared))
        self._replies.add(reply)
        reply.add_done_callback(self._settled)
        stream = self.server.reply_stream(request.chat, prepared[3])
        opened = False
        async for text in live_text(tokens, stream):
            if not opened:
                opened = True
                for line in _open_message(event, message_id):
                    yield line
            yield event("response.output_text.delta", item_id=message_id, output_index=0,
                        content_index=0, delta=text, logprobs=[])
        try:  # shielded: a client leaving now must not cancel the reply being recorded
            body = await asyncio.shield(reply)
        except Exception as err:  # noqa: BLE001 - the stream has started: the error goes in it
            failed = {**start, "status": "failed", "error": {
                "code": "server_error", "message": f"{type(err).__name__}: {err}"}}
            yield event("response.failed", response=failed)
            return
        for line in _finish_items(event, body["output"], stream, opened):
            yield line
        yield event("response.completed" if body["status"] == "completed"
                    else "response.incomplete", response=body)

    def _settled(self, task: asyncio.Task) -> None:
        self._replies.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a dropped stream's failure is not logged twice


def _open_message(event: Events, message_id: str) -> list[str]:
    item = {"type": "message", "id": message_id, "status": "in_progress",
            "role": "assistant", "content": []}
    return [event("response.output_item.added", output_index=0, item=item),
            event("response.content_part.added", item_id=message_id, output_index=0,
                  content_index=0, part=text_part(""))]


def _finish_items(event: Events, output: list[dict], stream: ReplyStream, opened: bool
                  ) -> list[str]:
    """The events after the live text: the rest of the message's text and its end, then
    each function call (whole: its arguments come once the call is parsed)."""
    lines = []
    for index, item in enumerate(output):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            if not opened:
                lines += _open_message(event, item["id"])
            if rest := stream.rest(text):
                lines.append(event("response.output_text.delta", item_id=item["id"],
                                   output_index=index, content_index=0, delta=rest,
                                   logprobs=[]))
            lines += [event("response.output_text.done", item_id=item["id"],
                            output_index=index, content_index=0, text=text, logprobs=[]),
                      event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=text_part(text))]
        else:
            lines += [event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"}),
                      event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=index, delta=item["arguments"]),
                      event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, name=item["name"],
                            arguments=item["arguments"])]
        lines.append(event("response.output_item.done", output_index=index, item=item))
    return lines
