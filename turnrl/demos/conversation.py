"""One conversation (OpenAI chat format) as the token sequence the turn loop would have made.

The turn loop (rollout/loop.py) never re-tokenises: the prompt is the template's render of
the first messages; each reply is the tokens the policy sampled, its end-of-turn token
included; what follows (the env's user or tool messages and the next generation prompt) is
the *delta* of the template's render, tokenised on its own (``ChatFormat.continue_after``).
A demonstration is tokenised the same way, its replies as the tokenizer encodes their text,
so SFT trains on exactly the ids an RL episode of the same conversation holds: loss on the
assistant's tokens (and its end of turn), none on anything else.

Tool calls render as the turn loop renders that model's tool turns (``loop_messages``):
where the template has a tool format (``ChatFormat.native_tools``) it shows ``tools`` and the
calls, and tool results go back as ``tool`` messages where it has that role
(``ChatFormat.tool_role``), else as one user message of ``<tool_response>`` blocks. Where it
has no tool format (SmolLM2's, the tiny model's) a demonstration is played in the fallback
the loop teaches: the tools described in the system prompt after its own text
(``fallback_system_prompt``), each call written in the reply as ``<tool_call>`` JSON after the
content (``render_call``), the results of a run of tool messages as one user message
(``format_tool_results``). A tool message's content is the result's ``content`` (the loop
writes a failed call as ``error``; a demonstration cannot tell them apart).

A demonstration the template cannot render exactly is refused (``DemoError``, the reason in
one line): a template that rewrites an earlier turn, renders an assistant message as other
than its content and end of turn, drops a tool call, or a message order the loop cannot
produce.
"""

from __future__ import annotations

import json

from turnrl.rollout.chat import ChatFormat
from turnrl.tools import ToolResult, fallback_system_prompt, format_tool_results, render_call
from turnrl.tools.schema import Tool
from turnrl.types import Episode, Turn


class DemoError(ValueError):
    """A demonstration that cannot be tokenised as the turn loop would; one line, the why."""


def conversation_episode(chat: ChatFormat, messages: list[dict], tools: list[dict] | None = None,
                         *, env: str = "sft", seed: int = 0) -> Episode:
    """``messages`` (OpenAI chat format) as an ``Episode``: assistant tokens loss_mask 1
    (0 for a reply with OpenAI's ``"weight": 0``, kept as context only).

    ``tools`` (JSON schemas) and tool calls are rendered as the loop renders an env with
    tools for this template (``loop_messages``): by the template where it has a tool
    format, else in the fallback format the env teaches. Messages after the last assistant reply are left out: a played episode ends with
    the policy's last reply. Raises ``DemoError`` when the template cannot render it exactly.
    """
    messages, tools = loop_messages(chat, messages, tools)
    check_roles(messages)
    rendered_messages = [template_message(m) for m in messages]
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    rendered = chat.render(rendered_messages[:first], True, tools)
    episode = Episode(env=env, seed=seed, group=seed, status="done")
    episode.append(chat.encode(rendered), policy=False)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for index, at in enumerate(replies):
        action = reply_text(chat, rendered_messages, at, rendered, tools)
        ids = chat.encode(action) + [chat.end_of_turn]
        trained = messages[at].get("weight", 1) != 0  # OpenAI's per-reply weight 0: context
        start, end = episode.append(ids, policy=trained,
                                    logprobs=[0.0] * len(ids) if trained else (), version=0)
        following = replies[index + 1] if index + 1 < len(replies) else None
        observation = "\n".join(str(m.get("content") or "")
                                for m in messages[at + 1:following or len(messages)])
        episode.turns.append(Turn(start, end, action, observation, 0.0, "stop"))
        if following is None:
            break
        rendered, ids = env_delta(chat, rendered_messages[:following], rendered, action, at,
                                  tools)
        episode.append(ids, policy=False)
    return episode


def loop_messages(chat: ChatFormat, messages: list[dict], tools: list[dict] | None
                  ) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools for the template) as the turn loop holds a tool episode of this
    template: calls as ``<tool_call>`` text and the tools in the system prompt where the
    template has no tool format; tool results as one user message where it has no tool
    role. Anything else is passed on as it is."""
    native = chat.native_tools is not None
    out, run, names = [], [], {}
    for message in messages:
        if message["role"] == "tool" and not chat.tool_role:
            run.append(message)
            continue
        if run:
            out.append(results_message(run, names))
            run = []
        for call in message.get("tool_calls") or ():
            names[call.get("id")] = call["function"]["name"]
        out.append(message if native or not message.get("tool_calls") else calls_as_text(message))
    if run:
        out.append(results_message(run, names))
    if native or not tools:
        return out, tools
    return fallback_system(out, tools), None


def fallback_system(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` with the system prompt a ``ToolEnv`` writes for a template without tools:
    the demonstration's own system text (its instructions) first, then the tools."""
    own = messages[0]["role"] == "system" if messages else False
    instructions = str(messages[0].get("content") or "") if own else ""
    described = [schema_tool(schema) for schema in tools]
    system = {"role": "system", "content": fallback_system_prompt(described, instructions)}
    return [system, *messages[1 if own else 0:]]


def schema_tool(schema: dict) -> Tool:
    """A tool schema (OpenAI's function format) as the ``Tool`` whose ``schema()`` it is:
    listed in the system prompt as an env's own tool is, never called."""
    function = schema["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return Tool(function["name"], function.get("description") or "", parameters, None)


def calls_as_text(message: dict) -> dict:
    """An assistant message with ``tool_calls`` as the reply a policy writes in the fallback
    format: its content, then one ``<tool_call>`` block per call, a line apart."""
    calls = [render_call(c["function"]["name"], _arguments(c), "hermes")
             for c in message["tool_calls"]]
    content = str(message.get("content") or "")
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = "\n".join([content, *calls] if content else calls)
    return out


def results_message(run: list[dict], names: dict) -> dict:
    """Tool messages answering one reply as the user message the loop sends back where the
    template has no tool role: their ``<tool_response>`` blocks, in order."""
    results = [ToolResult(m.get("name") or names.get(m.get("tool_call_id"), ""),
                          str(m.get("content") or "")) for m in run]
    return {"role": "user", "content": format_tool_results(results)}


def check_roles(messages: list[dict]) -> None:
    """Refuse an order of messages the turn loop never produces."""
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise DemoError("no assistant message: nothing to train on")
    if "system" in roles[1:]:
        raise DemoError(f"a system message at messages[{roles.index('system', 1)}]: the turn "
                        "loop only puts one first")
    first = roles.index("assistant")
    if "user" not in roles[:first]:
        raise DemoError("the first assistant message answers no user message")
    for i in range(1, len(roles)):
        if roles[i] == roles[i - 1] == "assistant":
            raise DemoError(f"messages[{i - 1}] and [{i}] are both assistant messages: the turn "
                            "loop puts a user or tool message between replies")


def template_message(message: dict) -> dict:
    """The message as chat templates take it: tool-call arguments as objects (Hugging Face's
    convention; OpenAI sends JSON strings), ``name`` on a tool message where the call had it."""
    out = {k: v for k, v in message.items() if k not in ("tool_calls", "weight")}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": _arguments(call)}}
            for call in message["tool_calls"]]
        out.setdefault("content", "")
        if out["content"] is None:
            out["content"] = ""
    return out


def _arguments(call: dict) -> dict:
    arguments = call["function"].get("arguments", {})
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def reply_text(chat: ChatFormat, messages: list[dict], at: int, rendered: str,
               tools: list[dict] | None) -> str:
    """The text the policy writes for assistant ``messages[at]``: what the template renders
    after the generation prompt, up to its end of turn, which must come straight after it
    (a content-only reply must render as exactly its content)."""
    full = chat.render(messages[:at + 1], False, tools)
    where = f"assistant message messages[{at}]"
    if not full.startswith(rendered):
        raise DemoError(f"the chat template renders {where} differently from the generation "
                        f"prompt it was asked with ({_difference(full, rendered)})")
    body = full[len(rendered):]
    end = body.find(chat.end_of_turn_text)
    if end < 0:
        raise DemoError(f"the chat template renders {where} without its end-of-turn token "
                        f"{chat.end_of_turn_text!r}")
    action = body[:end]
    message = messages[at]
    if message.get("tool_calls"):
        missing = [c["function"]["name"] for c in message["tool_calls"]
                   if c["function"]["name"] not in action]
        if missing:
            raise DemoError(f"the chat template drops the tool call(s) {missing} of {where}")
        if message["content"] and message["content"] not in action:
            raise DemoError(f"the chat template drops the content of {where}, which has "
                            "tool calls")
    elif action != message["content"]:
        raise DemoError(f"the chat template does not render {where} as its content "
                        f"({_difference(action, message['content'])}); the policy could "
                        "never have written it: fix the content or the template")
    return action


def env_delta(chat: ChatFormat, messages: list[dict], rendered: str, action: str, at: int,
              tools: list[dict] | None) -> tuple[str, list[int]]:
    """(new rendered text, token ids) of what follows reply ``messages[at]``: the end of its
    turn (already a policy token), the next messages and the generation prompt; exactly
    ``ChatFormat.continue_after``'s delta, which requires earlier turns rendered unchanged."""
    full = chat.render(messages, True, tools)
    prefix = rendered + action + chat.end_of_turn_text
    if not full.startswith(prefix):
        raise DemoError(f"the chat template rewrites the conversation up to assistant message "
                        f"messages[{at}] once later messages follow "
                        f"({_difference(full, prefix)}); token-in-token-out needs earlier "
                        "turns rendered unchanged")
    return full, chat.encode(full[len(prefix):])


def _difference(a: str, b: str) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
              min(len(a), len(b)))
    return f"differs at char {at}: {a[at:at + 30]!r} vs {b[at:at + 30]!r}"


def episode_conversation(chat: ChatFormat, episode: Episode, system_prompt: str | None,
                         first_observation: str) -> list[dict]:
    """The OpenAI-format conversation of a played episode without tools: what a recorder of
    the loop's episodes would write (user observations, the assistant's replies as text)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": first_observation})
    for i, turn in enumerate(episode.turns):
        messages.append({"role": "assistant", "content": turn.action})
        if i + 1 < len(episode.turns):
            messages.append({"role": "user", "content": turn.observation})
    return messages
