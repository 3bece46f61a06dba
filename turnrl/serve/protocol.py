"""The OpenAI chat-completions wire format: request checks and response shapes, pure functions.

Bodies are checked by hand, not by a schema library, so every bad request gets OpenAI's error
shape (``{"error": {"message", "type", "param", "code"}}``) with status 400 and one line that
names the field and the fix, the way the official client expects to read it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")
EPISODE_HEADER = "X-TurnRL-Episode"
EPISODE_FIELD = "turnrl_episode"
"""Body field carrying the episode id (the openai client's ``extra_body``)."""


class ApiError(Exception):
    """A request the server refuses: HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    """Checked messages: role, content as a string (text parts joined), tool fields kept."""
    tools: list[dict] | None = None
    tool_choice: str | dict = "auto"
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    episode: str | None = None
    extra: dict = field(default_factory=dict)


def _number(body: dict, name: str, default: float, low: float, high: float,
            integer: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        what = "an integer" if integer else "a number"
        raise bad(f"'{name}' must be {what} in [{low:g}, {high:g}], got {value!r}", name)
    return value


def _text(content, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) "
                          "are supported by this text-only model", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content must be a string or a list of text parts, got "
              f"{type(content).__name__}", f"{where}.content")


def check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {'role', 'content'} objects",
                  "messages")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(f"{where} needs a 'role', one of {', '.join(ROLES)}", f"{where}.role")
        role = message["role"]
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list):
            raise bad(f"{where}.tool_calls must be a list of tool calls", f"{where}.tool_calls")
        out = {"role": "system" if role == "developer" else role}
        if role == "assistant" and message.get("content") is None and calls:
            out["content"] = None
        elif "content" not in message or message["content"] is None:
            raise bad(f"{where} ({role}) has no 'content'", f"{where}.content")
        else:
            out["content"] = _text(message["content"], where)
        if role == "assistant" and calls:
            out["tool_calls"] = [_check_call(c, f"{where}.tool_calls[{j}]")
                                 for j, c in enumerate(calls)]
        if role == "tool":
            out["tool_call_id"] = str(message.get("tool_call_id", ""))
            if message.get("name"):
                out["name"] = str(message["name"])
        checked.append(out)
    return checked


def _check_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where} needs {{'id', 'type': 'function', 'function': {{'name', "
                  "'arguments'}}}}", where)
    arguments = fn.get("arguments", "")
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": fn["name"], "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments)}}


def check_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', "
                      "'description', 'parameters'}}}}", f"tools[{i}]")
    return tools or None


def check_tool_choice(tool_choice, tools: list[dict] | None) -> str | dict:
    """"none", "auto", "required" or ``{"type": "function", "function": {"name": N}}``
    naming one of ``tools``; the last two need tools (the server forces a call)."""
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (tool_choice in TOOL_CHOICES or isinstance(fn, dict)
            and tool_choice.get("type") == "function" and isinstance(fn.get("name"), str)):
        raise bad(f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
                  "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if tool_choice in ("none", "auto"):
        return tool_choice
    if not tools:
        raise bad("'tool_choice' forces a tool call but no 'tools' were given: pass the tools "
                  "or drop tool_choice", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if fn is not None and fn["name"] not in names:
        raise bad(f"tool_choice names the function '{fn['name']}', which is not among the "
                  f"tools ({', '.join(names)}): name one of them", "tool_choice")
    return tool_choice


def parse_chat_request(body, episode_header: str | None, max_n: int) -> ChatRequest:
    """Check a /v1/chat/completions body; raise ``ApiError`` (400) naming what is wrong."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise bad("'model' is required (see GET /v1/models)", "model")
    tools = check_tools(body.get("tools"))
    tool_choice = check_tool_choice(body.get("tool_choice") or "auto", tools)
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) \
        else () if stop is None else (None,)  # (None,): refused just below
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise bad("'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    top_logprobs = int(_number(body, "top_logprobs", 0, 0, 20, True))
    if top_logprobs and not body.get("logprobs"):
        raise bad("'top_logprobs' needs logprobs=true", "top_logprobs")
    if top_logprobs and body.get("stream"):
        raise bad("'top_logprobs' cannot be streamed (they are scored once the reply is "
                  "complete): drop stream or top_logprobs", "top_logprobs")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        max_tokens = int(_number({"max_tokens": max_tokens}, "max_tokens", 1, 1, 1 << 20, True))
    episode = body.get(EPISODE_FIELD) or episode_header
    if not isinstance(episode, str | None):
        raise bad(f"'{EPISODE_FIELD}' must be a string (the episode id)", EPISODE_FIELD)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object such as {\"include_usage\": true}",
                  "stream_options")
    request = ChatRequest(
        model=body["model"], messages=check_messages(body.get("messages")),
        tools=tools, tool_choice=tool_choice,
        n=int(_number(body, "n", 1, 1, max_n, True)),
        temperature=float(_number(body, "temperature", 1.0, 0, 2)),
        top_p=float(_number(body, "top_p", 1.0, 1e-9, 1)),
        max_tokens=max_tokens, stop=stop, logprobs=bool(body.get("logprobs")),
        top_logprobs=top_logprobs,
        stream=bool(body.get("stream")), include_usage=bool(options.get("include_usage")),
        episode=str(episode) if episode else None)
    if request.episode and request.n > 1:
        raise bad("n > 1 cannot be recorded into one episode (which choice would the agent "
                  "continue?); make n calls, or run the agent n times, each with its own "
                  "episode id", "n")
    return request


# ---- responses --------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def logprobs_block(tokens: list[str], logprobs: list[float],
                   top: list[list[tuple[str, float]]] | None = None) -> dict:
    """OpenAI's ``logprobs`` of a choice; ``top``: the likeliest (token, logprob) at each."""
    top = top or [[] for _ in tokens]
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())}
                                          for a, b in alternatives]}
                        for t, lp, alternatives in zip(tokens, logprobs, top, strict=True)]}


def choice_message(content: str | None, tool_calls: list[dict]) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def completion_body(request_id: str, model: str, choices: list[dict], prompt_tokens: int,
                    completion_tokens: int) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chunk_body(request_id: str, model: str, index: int, delta: dict,
               finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [choice]}
