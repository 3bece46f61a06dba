"""The chat template as token deltas: render a conversation turn by turn, tokenise only what is new.

Token-in-token-out: the ids the policy is trained on are exactly the ids it sampled. The
conversation is never re-tokenised; each environment reply is rendered with the chat
template and only the *new* text is tokenised and appended. That is sound only when the
template renders earlier turns unchanged as the conversation grows, which
``ChatFormat.check`` verifies at start-up (templates that strip whitespace, drop reasoning
or move a system prompt break it silently in other frameworks).
"""

from __future__ import annotations

import functools

from transformers import PreTrainedTokenizerBase

from turnrl.tools.native import native_tool_format


class TemplateError(ValueError):
    """The tokenizer's chat template cannot support token-in-token-out multi-turn rollouts."""


class ChatFormat:
    """Renders a conversation turn by turn as token deltas."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template; use an instruct model or "
                                "set tokenizer.chat_template before training")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.end_of_turn = tokenizer.eos_token_id
        self.end_of_turn_text = tokenizer.decode([self.end_of_turn])

    def render(self, messages: list[dict], generation_prompt: bool,
               tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def start(self, observation: str, system_prompt: str | None = None,
              tools: list[dict] | None = None) -> tuple[list[dict], str, list[int]]:
        """The first prompt: (messages, rendered text, token ids).

        ``system_prompt`` (the environment's) overrides the one given at construction;
        with neither, the template's own default applies. ``tools`` (JSON schemas) are
        rendered by the template itself (see ``env_prompt``); pass them on every turn.
        """
        system_prompt = system_prompt or self.system_prompt
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": observation})
        text = self.render(messages, True, tools)
        return messages, text, self.encode(text)

    # ---- tools: the model's own format where its template has one (issue 14) ----------------

    @functools.cached_property
    def native_tools(self) -> str | None:
        """The template's own tool-call format ("hermes", "llama3-json"), or None when it
        renders no tools (SmolLM2's): then envs teach the fallback in their system prompt."""
        return native_tool_format(self.tokenizer)

    @functools.cached_property
    def tool_role(self) -> bool:
        """Whether tool results can go back as ``tool`` messages: the template has native
        tools, renders a tool message's content, and keeps earlier turns unchanged."""
        if self.native_tools is None:
            return False
        messages = [{"role": "user", "content": "What is 2+2?"},
                    {"role": "assistant", "content": PROBES[3][1]},
                    {"role": "tool", "name": "add", "content": "probe-4"}]
        try:
            return "probe-4" in self.render(messages, True, [_PROBE_SCHEMA])
        except Exception:  # noqa: BLE001 - a template that cannot render the role lacks it
            return False

    def env_prompt(self, env) -> tuple[str | None, list[dict] | None]:
        """(system prompt, tool schemas for the template) of a freshly reset env. An env with
        ``tools`` and ``tool_prompt(native_format)`` (``ToolEnv``) is told the model's own
        call format; with a template without tools it teaches the fallback itself."""
        if getattr(env, "tools", None) and hasattr(env, "tool_prompt"):
            return env.tool_prompt(self.native_tools)
        return getattr(env, "system_prompt", None), None

    def continue_after(self, messages: list[dict], rendered: str, action: str, stopped: bool,
                       observation: str, tool_results: list[dict] | None = None,
                       tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """Tokens that follow the policy's reply: end of its turn, the env's reply, our turn.

        ``rendered`` is the text so far (the policy's reply not included); ``stopped`` tells
        whether the policy itself sampled the end-of-turn token, which then is not repeated.
        ``tool_results`` ({"name", "content" or "error"} per call) of an episode started with
        ``tools`` go back as ``tool`` messages where the template has that role, else the
        observation goes back as a user message.
        Appends the messages to ``messages``; returns (new rendered text, new token ids).
        """
        messages.append({"role": "assistant", "content": action})
        if tool_results and tools is not None and self.tool_role:
            messages += [{"role": "tool", "name": r["name"],
                          "content": r["content"] if "content" in r else f"error: {r['error']}"}
                         for r in tool_results]
        else:
            messages.append({"role": "user", "content": observation})
        full = self.render(messages, True, tools)
        prefix = rendered + action
        if not full.startswith(prefix):
            at = next((i for i, (a, b) in enumerate(zip(full, prefix, strict=False)) if a != b),
                      min(len(full), len(prefix)))
            raise TemplateError(
                f"the chat template does not preserve the conversation prefix at turn "
                f"{len(messages) // 2} (differs at char {at}: {full[at:at + 30]!r} vs "
                f"{prefix[at:at + 30]!r}); token-in-token-out training needs a template that "
                "renders earlier turns unchanged: fix tokenizer.chat_template")
        rest = full[len(prefix):]
        if stopped and rest.startswith(self.end_of_turn_text):
            rest = rest[len(self.end_of_turn_text):]
        return full, self.encode(rest)

    def check(self) -> None:
        """Verify that every turn extends the previous render, for the content real policies
        write (``PROBES``) and, where the template has native tools, for a tool call answered
        by ``tool`` messages; name the content a template rewrites, and the fix."""
        cases = [(kind, action, reply, None, None) for kind, action, reply in PROBES]
        if self.tool_role:
            cases.append(("a tool call answered by a tool message", PROBES[3][1], "",
                           [{"name": "add", "content": "4"}], [_PROBE_SCHEMA]))
        for kind, action, reply, results, tools in cases:
            messages, rendered, _ = self.start("What is 2+2?", tools=tools)
            try:
                rendered, _ = self.continue_after(messages, rendered, action, True, reply,
                                                  results, tools)
                self.continue_after(messages, rendered, "4", True, "Thanks.", None, tools)
            except TemplateError as err:
                raise TemplateError(
                    f"the chat template rewrites earlier assistant turns that contain {kind} "
                    f"({err.args[0].split('; ')[0].removeprefix('the chat template ')}); "
                    "token-in-token-out training needs earlier turns rendered unchanged: pass a "
                    "template that keeps them as --model.chat_template FILE.jinja (e.g. the "
                    "model's own template without that rewriting)") from None


PROBES = (
    ("plain text", "4", "Correct. And 3+3?"),
    ("surrounding whitespace", " 6 ", "Yes!\nNext: 1+1"),
    ("a reasoning block", "<think>2 and 2 make 4.</think>The answer is 4.", "Right."),
    ("a tool call", '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>',
     '{"result": 4}'),
    ("newlines and special characters", "Line one\n\n  na\u00efve \u2014 10% & <b>x</b> \U0001f642\n",
     "Noted: \u2713"),
)
"""(what it is, a policy's reply, the env's answer): contents templates are known to rewrite
in earlier turns (Qwen3's drops reasoning blocks; some trim whitespace)."""

_PROBE_SCHEMA = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}}
