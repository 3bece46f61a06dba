"""The chat template as token deltas: render a conversation turn by turn, tokenise only what is new.

Token-in-token-out: the ids the policy is trained on are exactly the ids it sampled. The
conversation is never re-tokenised; each environment reply is rendered with the chat
template and only the *new* text is tokenised and appended. That is sound only when the
template renders earlier turns unchanged as the conversation grows, which
``ChatFormat.check`` verifies at start-up (templates that strip whitespace, drop reasoning
or move a system prompt break it silently in other frameworks): with the contents policies
write, with the sizes and shapes of real episodes (long tool results, several tools, long
turns and histories, many turns), and under different clocks and random states (a date in
the system prompt changes at midnight; a random id every render). ~20 ms CPU.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import random
import threading
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from turnrl.datafile import DataFileError, read_text
from turnrl.envs.contract import prompt_and_tools
from turnrl.samplers.base import SamplingParams
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
        return prompt_and_tools(env, self.native_tools)  # the env contract: envs/contract.py

    def env_messages(self, observation: str, tool_results: list[dict] | None,
                     tools: list[dict] | None) -> list[dict]:
        """The messages that carry the env's reply: ``tool`` messages for ``tool_results`` of
        an episode started with ``tools`` where the template has that role, else the
        observation as a user message."""
        if tool_results and tools is not None and self.tool_role:
            return [{"role": "tool", "name": r["name"],
                     "content": r["content"] if "content" in r else f"error: {r['error']}"}
                    for r in tool_results]
        return [{"role": "user", "content": observation}]

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
        full, rest = self._extend(messages, rendered, action, stopped, observation,
                                  tool_results, tools)
        return full, self.encode(rest)

    def _extend(self, messages: list[dict], rendered: str, action: str, stopped: bool,
                observation: str, tool_results: list[dict] | None,
                tools: list[dict] | None) -> tuple[str, str]:
        """``continue_after`` without the tokenising: (new rendered text, the new text)."""
        messages.append({"role": "assistant", "content": action})
        messages += self.env_messages(observation, tool_results, tools)
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
        return full, rest

    def check(self) -> None:
        """``_check``, with an error the template itself raises while rendering a probe
        (``raise_exception``, an undefined name, a division by zero) as a one-line
        ``TemplateError`` too: every rollout renders such conversations."""
        try:
            self._check()
        except TemplateError:
            raise
        except Exception as err:  # noqa: BLE001 - the template's own error, at start-up
            raise TemplateError(f"the chat template fails to render a plain conversation "
                                f"(system, user and assistant turns): {_one_line(err)}; fix "
                                "the template, or pass one that renders it as "
                                "--model.chat_template FILE.jinja") from None

    def _check(self) -> None:
        """Verify at start-up that the template renders the same conversation the same way
        whatever the clock and random state (``_check_deterministic``), and that every turn
        extends the previous render: for the content real policies write (``PROBES``), for
        a tool call answered by ``tool`` messages where the template has them, and for the
        sizes and shapes of real episodes (``SHAPES``: long tool results, several tools and
        calls, long turns, many turns). A refusal names the cause and the fix."""
        self._check_deterministic()
        cases = [(kind, action, reply, None, None) for kind, action, reply in PROBES]
        if self.tool_role:
            cases.append(("a tool call answered by a tool message", PROBES[3][1], "",
                          [{"name": "add", "content": "4"}], [_PROBE_SCHEMA]))
        for kind, action, reply, results, tools in cases:
            messages = [{"role": "user", "content": "What is 2+2?"}]
            rendered = self.render(messages, True, tools)
            try:
                rendered, _ = self._extend(messages, rendered, action, True, reply, results,
                                           tools)
                self._extend(messages, rendered, "4", True, "Thanks.", None, tools)
            except TemplateError as err:
                raise TemplateError(
                    f"the chat template rewrites earlier assistant turns that contain {kind} "
                    f"({_where(err)}); token-in-token-out training needs earlier turns "
                    f"rendered unchanged: {_FIX}") from None
        for kind, turns in SHAPES:
            self._check_shape(kind, turns)

    def _check_shape(self, kind: str, turns: tuple[tuple[str, str, list[dict] | None], ...]
                     ) -> None:
        """Play ``turns`` (action, user reply, tool results) as one conversation; a template
        without the tool role gets the results as the user reply, as rollouts do."""
        tools = _SHAPE_SCHEMAS if self.tool_role else None
        messages = [*self._probe_system,
                    {"role": "user", "content": "Solve the task; use the tools when they help."}]
        rendered = self.render(messages, True, tools)
        try:
            for action, reply, results in turns:
                if results is not None and not self.tool_role:
                    reply = "\n".join(r["content"] for r in results)
                rendered, _ = self._extend(messages, rendered, action, True, reply, results,
                                           tools)
        except TemplateError as err:
            raise TemplateError(
                f"the chat template rewrites earlier turns of a conversation with {kind} "
                f"({_where(err)}); token-in-token-out training needs earlier turns rendered "
                f"unchanged: {_FIX}") from None
        except Exception as err:  # noqa: BLE001 - the template's own error, at start-up
            raise TemplateError(
                f"the chat template cannot render a conversation with {kind} "
                f"({type(err).__name__}: {str(err)[:200]}); rollouts produce such "
                f"conversations: {_FIX}") from None

    @functools.cached_property
    def _probe_system(self) -> list[dict]:
        """A system message for the probes, or none where the template refuses the role
        (Gemma-style templates raise for it; rollouts then have none either)."""
        system = [{"role": "system", "content": "You are a careful assistant."}]
        try:
            self.render([*system, {"role": "user", "content": "Hi"}], True)
            return system
        except Exception:  # noqa: BLE001 - the template's own refusal
            return []

    def _check_deterministic(self) -> None:
        """Render one conversation under clocks far apart and across midnight (through the
        date helpers templates can call, ``strftime_now``) and under different random
        states (Jinja's ``random`` filter, ``lipsum``): a render that changes would change
        the prompt mid-run (a date at midnight, a random id every turn)."""
        messages = [*self._probe_system, {"role": "user", "content": "What is 2+2?"},
                    {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "Thanks."}]

        tools = _SHAPE_SCHEMAS if self.native_tools else None  # some show a date with tools

        def render(clock: datetime.datetime, seed: int) -> str:
            with _fixed_clock_and_random(clock, seed):
                with_tools = self.render(messages, True, tools) if tools else ""
                return self.render(messages, True) + with_tools

        first = render(_CLOCKS[0], 0)
        for clock in _CLOCKS[1:]:
            if (other := render(clock, 0)) != first:
                raise TemplateError(
                    f"the chat template renders the date or time (e.g. strftime_now): the "
                    f"same conversation renders differently at {_CLOCKS[0]:%Y-%m-%d %H:%M:%S}"
                    f" and at {clock:%Y-%m-%d %H:%M:%S} ({_first_difference(first, other)}), "
                    "so the prompt would change mid-run (at the latest at midnight) and "
                    "break token-in-token-out; pass a template with a fixed date (or none) "
                    "as --model.chat_template FILE.jinja")
        for seed in (1, 2):
            if (other := render(_CLOCKS[0], seed)) != first:
                raise TemplateError(
                    f"the chat template uses random numbers (e.g. a random id, the `random` "
                    f"filter or lipsum): the same conversation renders differently under "
                    f"two random states ({_first_difference(first, other)}), so the prompt "
                    "would change between turns and break token-in-token-out; pass a "
                    "template without them as --model.chat_template FILE.jinja")
        if render(_CLOCKS[0], 0) != first:
            raise TemplateError(
                "the chat template renders the same conversation differently twice under the "
                "same clock and random state, so the prompt would change between turns and "
                "break token-in-token-out; pass a deterministic template as "
                "--model.chat_template FILE.jinja")


def _one_line(err: BaseException) -> str:
    """``err`` as one bounded line: its type and message."""
    message = " ".join(str(err).split())[:300]
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def read_chat_template(path: str) -> str:
    """The chat template in the file ``path`` (``--model.chat_template``), checked: readable
    UTF-8 text (a byte-order mark dropped), not empty, valid Jinja (compiled as transformers
    compiles it). ``TemplateError``, one line naming the file, the problem and the fix, else."""
    def bad(what: str) -> TemplateError:
        return TemplateError(f"--model.chat_template '{path}' {what}; pass a Jinja chat "
                             "template file (e.g. the model's own, from its "
                             "tokenizer_config.json 'chat_template', edited)")
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as err:
        raise bad(f"cannot be read ({err.strerror or type(err).__name__})") from None
    if b"\0" in data:
        raise bad("is binary (it holds NUL bytes), not a text file")
    try:  # UTF-8, a byte-order mark dropped; a bad byte named by its line (turnrl.datafile)
        text = read_text(Path(path).expanduser())
    except DataFileError as err:  # "FILE:LINE: what; fix"
        line, _, what = str(err).removeprefix(f"{Path(path).expanduser()}:").partition(": ")
        raise TemplateError(f"--model.chat_template '{path}' line {line}: {what}") from None
    if not text.strip():
        raise bad("is empty")
    try:
        _compile(text)
    except Exception as err:  # noqa: BLE001 - Jinja's syntax errors, and its other refusals
        line = getattr(err, "lineno", None)
        raise bad(f"is not valid Jinja ({f'line {line}: ' if line else ''}{_one_line(err)})"
                  ) from None
    return text


def checked_chat(tokenizer: PreTrainedTokenizerBase, template_file: str = "") -> ChatFormat:
    """``tokenizer``'s ``ChatFormat`` with the template in ``template_file`` ('' keeps its
    own; ``read_chat_template``), probed as at start-up (``ChatFormat.check``). A refusal is
    a one-line ``TemplateError``, naming the file when the template came from one."""
    if template_file:
        tokenizer.chat_template = read_chat_template(template_file)
    chat = ChatFormat(tokenizer)
    try:
        chat.check()
    except TemplateError as err:  # name the user's file: the fix is in it
        if not template_file:
            raise
        raise TemplateError(f"--model.chat_template '{template_file}': {err}") from None
    return chat


def _compile(text: str) -> None:
    """Compile ``text`` as transformers compiles chat templates (its tags and filters)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template
    _compile_jinja_template(text)


_FIX = ("pass a template that keeps them as --model.chat_template FILE.jinja (e.g. the "
        "model's own template without that rewriting)")


def _where(err: TemplateError) -> str:
    """The 'at turn N (differs at char C: ...)' part of a prefix error."""
    return err.args[0].split("; ")[0].removeprefix("the chat template ")


def _first_difference(a: str, b: str) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
              min(len(a), len(b)))
    return f"at char {at}: {a[at:at + 30]!r} vs {b[at:at + 30]!r}"


_CLOCKS = (datetime.datetime(2024, 1, 15, 10, 0, 0),
           datetime.datetime(2031, 7, 4, 23, 59, 59, 900000),
           datetime.datetime(2031, 7, 5, 0, 0, 1),  # 1.1 s later: past midnight
           datetime.datetime(2024, 2, 29, 0, 0, 0),
           *(datetime.datetime(2025 + day % 7, (1, 3, 5, 7, 8, 10, 12)[day % 7], day,
                               day * 7 % 24, day * 13 % 60, day * 29 % 60)
             for day in range(1, 32)))
"""Clocks the determinism probe renders under: years, months, weekdays, AM/PM and hours
apart, a pair across midnight, every day of the month and every hour of the day, so that a
template showing only a date, or something only at midnight or on the first of a month,
renders differently under some pair (~30 small renders: a few milliseconds)."""


@contextlib.contextmanager
def _fixed_clock_and_random(clock: datetime.datetime, seed: int):
    """Within: the template helpers' ``datetime.now()`` (and ``today``, ``utcnow``) return
    ``clock``, and Python's random module is seeded with ``seed``; both restored after.
    For the start-up probe only: a render on another thread meanwhile would see them too."""
    fixed = _fixed_datetime(clock)
    patched = [m for m in _clock_modules() if getattr(m, "datetime", None) is not None]
    saved = [m.datetime for m in patched]
    state = random.getstate()
    with _CLOCK_LOCK:
        try:
            for module in patched:
                module.datetime = fixed
            random.seed(seed)
            yield
        finally:
            for module, original in zip(patched, saved, strict=True):
                module.datetime = original
            random.setstate(state)


_CLOCK_LOCK = threading.Lock()


def _clock_modules() -> list:
    """Modules whose ``datetime`` the template helpers read (transformers' ``strftime_now``)."""
    from transformers.utils import chat_template_utils
    return [chat_template_utils]


def _fixed_datetime(clock: datetime.datetime) -> type:
    class Fixed(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return clock.replace(tzinfo=tz) if tz else clock

        @classmethod
        def today(cls):
            return clock

        @classmethod
        def utcnow(cls):
            return clock

    return Fixed


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


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _schema(name: str, description: str, **params: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description, "parameters": {
            "type": "object", "properties": {p: {"type": t} for p, t in params.items()},
            "required": list(params)}}}


_SHAPE_SCHEMAS = [_PROBE_SCHEMA,
                  _schema("python", "Run a Python program; returns what it prints.",
                          code="string"),
                  _schema("search", "Search the notes.", query="string", limit="integer"),
                  _schema("read_file", "Read a file.", path="string")]

# Program output as the python tool returns it, up to the sandbox's default output cap.
_LONG_OUTPUT = "".join(f"row {i:05d}: value={i * 37 % 1009:4d}  \tok\n" for i in range(2000))
_LONG_OUTPUT = (_LONG_OUTPUT * (64_000 // len(_LONG_OUTPUT) + 1))[:64_000]
_LONG_REPLY = ("Let me work through this step by step.\n\n" + "".join(
    f"Step {i}: the partial sum is {i * (i + 1) // 2}; next we add {i + 1}.\n" for i in range(300))
    + "```python\ndef total(n):\n    return n * (n + 1) // 2\n\n\nprint(total(300))\n```\n\n"
    "So the answer is 45150.  \n")
_LONG_QUESTION = "Here is the data:\n" + "; ".join(f"item {i} costs {i % 97} coins"
                                                   for i in range(800)) + "\nWhat is the total?"
# Turns of ~3,000 characters each: under the long-turn shapes above, a long history in all.
_HISTORY = tuple((f"Draft {i}:\n" + _LONG_REPLY[:1500], f"Notes on draft {i}:\n"
                  + _LONG_QUESTION[:1500], None) for i in range(30))
_HISTORY_CHARS = sum(len(a) + len(r) for a, r, _ in _HISTORY)
_FINISH = (("The answer is 4.", "Correct. One more: 3+3?", None), ("6", "Thanks.", None))
_RUN = _call("python", code="for i in range(2000): print(i)")

SHAPES = (
    ("several tools called in one turn",
     ((_call("add", a=2, b=2) + "\n" + _call("search", query="sum", limit=3) + "\n"
       + _call("read_file", path="notes.txt"),
       "", [{"name": "add", "content": "4"}, {"name": "search", "content": "[]"},
            {"name": "read_file", "content": "error: no such file"}]), *_FINISH)),
    (f"a long assistant turn ({len(_LONG_REPLY)} characters)",
     ((_LONG_REPLY, "Please check it.", None), *_FINISH)),
    (f"a long user message ({len(_LONG_QUESTION)} characters)",
     (("Send the data.", _LONG_QUESTION, None), *_FINISH)),
    ("many turns (40)",
     tuple((f"Guess {i}.", f"Wrong, try again ({i}).", None) for i in range(40))),
    (f"a long history ({len(_HISTORY)} turns, {_HISTORY_CHARS} characters)", _HISTORY),
    (f"a long tool result ({len(_LONG_OUTPUT)} characters)",
     ((_RUN, "", [{"name": "python", "content": _LONG_OUTPUT}]), *_FINISH)),
    ("many tool calls over many turns (20 calls)",
     tuple((_call("add", a=i, b=i), "", [{"name": "add", "content": str(2 * i)}])
           for i in range(20)) + _FINISH),
)
"""(what it is, turns of (action, the user's reply, tool results or None)): the sizes and
shapes of real episodes, each alone so that a refusal names it. Templates rewrite history
by length (truncating long results or turns, trimming a long conversation) or by position
(after k turns, older calls). Single long contents and many short turns come before the
long history, so a template that truncates one long message, or rewrites by position, is
named for that, not for the history."""


def sampling_params(cfg, chat: ChatFormat, temperature: float | None = None) -> SamplingParams:
    """The run's sampling settings (``rollout.*`` of config ``cfg``) for a model chatting in
    ``chat``: its end-of-turn token stops a reply."""
    temperature = cfg.rollout.temperature if temperature is None else temperature
    return SamplingParams(cfg.rollout.max_new_tokens, temperature, cfg.rollout.top_p,
                          stop_token_ids=(chat.end_of_turn,))
