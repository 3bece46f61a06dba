"""The Anthropic Messages API (``POST /v1/messages``): request checks, reply shapes, events.

A Messages request is checked here and turned into the chat request the server already
serves (``parse_messages_request``): ``system`` becomes the system message, ``tool_use``
blocks become assistant tool calls, ``tool_result`` blocks become tool messages. So a reply is
sampled, parsed for tool calls, remembered as the model wrote it and recorded into the
episode's one token sequence exactly as a chat completion is (serve/server.py, record.py);
only the wire shapes differ: ``message_body`` (JSON) and ``message_events`` (server-sent
events: message_start, content_block_start/delta/stop, message_delta, message_stop).
Errors take Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import quote

from turnrl.serve.protocol import EPISODE_FIELD, EPISODE_HEADER, ChatRequest, _number, bad, new_id
from turnrl.serve.server import Choice, Server
from turnrl.serve.stream import live_text

PATH = "/v1/messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}
TOOL_CHOICES = ("auto", "any", "tool", "none")


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---- the request ------------------------------------------------------------------------


def _blocks(content, where: str) -> list[dict]:
    """Content (at ``where``) as blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad(f"{where} must be a string or a list of content blocks", where)
    return content


def _text_of(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad(f"{where} is a text block without a string 'text'", where)
    return block["text"]


def _result_text(block: dict, where: str) -> str:
    """A tool_result's content (a string or text blocks) as text; "Error: " before an error's."""
    content = block.get("content") or ""
    text = "".join(_text_of(b, f"{where}.content[{k}]") if b.get("type") == "text" else _refuse(
        b, f"{where}.content[{k}]") for k, b in enumerate(_blocks(content, f"{where}.content")))
    return f"Error: {text}" if block.get("is_error") else text


def _refuse(block: dict, where: str) -> str:
    raise bad(f"{where}: a '{block.get('type')}' block is not supported by this text-only "
              "model: send text, tool_use and tool_result blocks", where)


def _user(blocks: list[dict], where: str) -> list[dict]:
    """A user turn as chat messages: each tool_result a tool message, text joined between."""
    out: list[dict] = []
    for k, block in enumerate(blocks):
        at = f"{where}.content[{k}]"
        if block.get("type") == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad(f"{at} (tool_result) needs the 'tool_use_id' of the call it answers", at)
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _result_text(block, at)})
        elif block.get("type") == "text":
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += _text_of(block, at)
            else:
                out.append({"role": "user", "content": _text_of(block, at)})
        else:
            _refuse(block, at)
    return out


def _assistant(blocks: list[dict], where: str) -> dict:
    """An assistant turn: its text blocks joined, its tool_use blocks as tool calls."""
    text, calls = [], []
    for k, block in enumerate(blocks):
        at = f"{where}.content[{k}]"
        if block.get("type") == "text":
            text.append(_text_of(block, at))
        elif block.get("type") == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise bad(f"{at} (tool_use) needs 'id', 'name' and an object 'input'", at)
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"])}})
        else:
            _refuse(block, at)
    message = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(system, messages) -> list[dict]:
    """``system`` and Anthropic ``messages`` as the checked chat messages the server renders."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {'role', 'content'} objects",
                  "messages")
    out = []
    if system is not None:
        blocks = _blocks(system, "system")
        text = "".join(_text_of(b, f"system[{k}]") if b.get("type") == "text"
                       else _refuse(b, f"system[{k}]") for k, b in enumerate(blocks))
        out.append({"role": "system", "content": text})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad(f"{where} needs a 'role', user or assistant (the system prompt goes in "
                      "the top-level 'system')", f"{where}.role")
        if "content" not in message:
            raise bad(f"{where} ({message['role']}) has no 'content'", f"{where}.content")
        blocks = _blocks(message["content"], f"{where}.content")
        out += _user(blocks, where) if message["role"] == "user" else [_assistant(blocks, where)]
    if messages[-1].get("role") != "user":
        raise bad("the last message must be the user's: continuing a partial assistant "
                  "reply (prefill) is not supported here", f"messages[{len(messages) - 1}]")
    return out


def chat_tools(tools, tool_choice) -> tuple[list[dict] | None, str | dict]:
    """Anthropic ``tools`` (name, description, input_schema) and ``tool_choice`` in chat shape."""
    if tools is not None and not isinstance(tools, list):
        raise bad("'tools' must be a list of {'name', 'description', 'input_schema'}", "tools")
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):
            raise bad(f"tools[{i}] must be an object {{'name', 'description', 'input_schema'}}",
                      f"tools[{i}]")
        if tool.get("type") not in (None, "custom"):
            raise bad(f"tools[{i}] is not a custom tool (type {tool['type']!r}): this server "
                      "runs no server tools; give {'name', 'input_schema'}", f"tools[{i}]")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"),
                                                                    dict):
            raise bad(f"tools[{i}] needs a 'name' and an 'input_schema' object", f"tools[{i}]")
        out.append({"type": "function", "function": {
            "name": tool["name"], "description": str(tool.get("description") or ""),
            "parameters": tool["input_schema"]}})
    choice = tool_choice or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in TOOL_CHOICES or kind == "tool" and not isinstance(choice.get("name"), str):
        raise bad("'tool_choice' must be {'type': 'auto'|'any'|'none'} or {'type': 'tool', "
                  "'name': N}", "tool_choice")
    if kind in ("any", "tool") and not out:
        raise bad("'tool_choice' forces a tool call but no 'tools' were given: pass the tools "
                  "or drop tool_choice", "tool_choice")
    names = [t["function"]["name"] for t in out]
    if kind == "tool" and choice["name"] not in names:
        raise bad(f"tool_choice names the tool '{choice['name']}', which is not among the "
                  f"tools ({', '.join(names)}): name one of them", "tool_choice")
    chat_choice = {"any": "required", "tool": {"type": "function", "function": {
        "name": choice.get("name")}}}.get(kind, kind)
    return out or None, chat_choice


def parse_messages_request(body, episode_header: str | None) -> ChatRequest:
    """Check a /v1/messages body; raise ``ApiError`` (400) naming what is wrong and the fix."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise bad("'model' is required (see GET /v1/models)", "model")
    if body.get("max_tokens") is None:
        raise bad("'max_tokens' is required: the most tokens the reply may have", "max_tokens")
    if body.get("top_k") is not None:
        raise bad("'top_k' is not supported by this server: drop it (top_p is)", "top_k")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop_sequences' must be a list of non-empty strings", "stop_sequences")
    episode = body.get(EPISODE_FIELD) or episode_header
    if not isinstance(episode, str | None):
        raise bad(f"'{EPISODE_FIELD}' must be a string (the episode id)", EPISODE_FIELD)
    tools, tool_choice = chat_tools(body.get("tools"), body.get("tool_choice"))
    return ChatRequest(
        model=body["model"], messages=chat_messages(body.get("system"), body.get("messages")),
        tools=tools, tool_choice=tool_choice,
        temperature=float(_number(body, "temperature", 1.0, 0, 1)),
        top_p=float(_number(body, "top_p", 1.0, 1e-9, 1)),
        max_tokens=int(_number(body, "max_tokens", 1, 1, 1 << 20, True)), stop=tuple(stops),
        stream=bool(body.get("stream")), episode=episode or None)


# ---- the reply --------------------------------------------------------------------------


def stop_reason(choice: Choice, decode, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): tool_use, max_tokens, end_turn (the model ended its turn)
    or stop_sequence (the reply was cut before one of ``stops``: the earliest, shortest)."""
    if choice.finish_reason == "tool_calls":
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if choice.visible < len(choice.token_ids) or not stops:
        return "end_turn", None
    text = decode(choice.token_ids[:choice.visible])
    hits = [(text.find(s), len(s), s) for s in stops if s in text]
    return "stop_sequence", min(hits)[2] if hits else None


def tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def message_body(server: Server, request: ChatRequest, choice: Choice,
                 prompt_tokens: int) -> dict:
    """The non-streamed reply: a text block (when there is text), then one tool_use block a
    call."""
    content = [{"type": "text", "text": choice.content}] if choice.content else []
    content += [tool_use(call) for call in choice.tool_calls]
    reason, sequence = stop_reason(choice, server.tokenizer.decode, request.stop)
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "model": server.name,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(choice.token_ids)}}


def event(name: str, body: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(body)}\n\n"


def _block(kind: str, index: int, **fields) -> str:
    return event(kind, {"type": kind, "index": index, **fields})


_replies: set[asyncio.Task] = set()
"""Replies whose client went away: still generated and recorded whole, held here until done
(an episode never keeps half a reply)."""


async def message_events(server: Server, request: ChatRequest, prepared: tuple):
    """Server-sent events: message_start, the text block as it is generated (what of it
    ``ReplyStream`` can already send), the rest of it, one tool_use block a call (its input
    as one input_json_delta), message_delta (stop reason, usage), message_stop."""
    tokens: asyncio.Queue = asyncio.Queue()
    reply = asyncio.create_task(server.complete(request, tokens, prepared))
    _replies.add(reply)
    reply.add_done_callback(_replies.discard)
    yield event("message_start", {"type": "message_start", "message": {
        "id": new_id("msg"), "type": "message", "role": "assistant", "model": server.name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(prepared[1]), "output_tokens": 0}}})
    stream = server.reply_stream(request, prepared[3])
    opened = False
    async for text in live_text(tokens, stream):
        if not opened:
            yield _block("content_block_start", 0, content_block={"type": "text", "text": ""})
            opened = True
        yield _block("content_block_delta", 0, delta={"type": "text_delta", "text": text})
    try:
        (choice,), _ = await reply
    except Exception as err:  # noqa: BLE001 - the stream has started: the error goes in it
        yield event("error", error_body(500, f"{type(err).__name__}: {err}"))
        return
    for line in _final_blocks(choice, stream.rest(choice.content or ""), opened):
        yield line
    reason, sequence = stop_reason(choice, server.tokenizer.decode, request.stop)
    yield event("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                  "usage": {"output_tokens": len(choice.token_ids)}})
    yield event("message_stop", {"type": "message_stop"})


def _final_blocks(choice: Choice, rest: str, opened: bool) -> list[str]:
    """The rest of the text block and its end, then each tool call as a tool_use block."""
    out = []
    if rest and not opened:
        out.append(_block("content_block_start", 0, content_block={"type": "text", "text": ""}))
    if rest:
        out.append(_block("content_block_delta", 0, delta={"type": "text_delta", "text": rest}))
    index = int(bool(rest or opened))
    if index:
        out.append(_block("content_block_stop", 0))
    for k, call in enumerate(choice.tool_calls, start=index):
        start = {**tool_use(call), "input": {}}
        out += [_block("content_block_start", k, content_block=start),
                _block("content_block_delta", k, delta={
                    "type": "input_json_delta", "partial_json": call["function"]["arguments"]}),
                _block("content_block_stop", k)]
    return out


def count_tokens(server: Server, request: ChatRequest) -> dict:
    """``POST /v1/messages/count_tokens``: the prompt's length as the server would feed it."""
    return {"input_tokens": len(server.prompt(request)[1])}



def anthropic_env(client) -> dict[str, str]:
    """The environment that points an Anthropic-API harness at the server ``client`` (the
    ``openai`` client ``train_agent`` hands a rollout) talks to, recording into its episode:
    ``ANTHROPIC_BASE_URL`` names the episode in its path (``.../v1/turnrl/episodes/ID``), so
    a harness that only takes a base URL and a key (the ``anthropic`` client reads both from
    the environment; Claude Code too) needs no extra header; ``ANTHROPIC_API_KEY``."""
    base = str(client.base_url).rstrip("/")
    episode = client.default_headers.get(EPISODE_HEADER)
    if isinstance(episode, str):
        base += f"/turnrl/episodes/{quote(episode, safe='')}"
    else:
        base = base.removesuffix("/v1")
    return {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": client.api_key}
