"""The start-up template probe (``ChatFormat.check``) against the class of templates that
break token-in-token-out: each template here is one variant of a class (rewrites by length,
by position, by clock, by random state) and must be refused with its own cause named, while
real templates (SmolLM2's, a Qwen-style and a Llama-style one written here) pass."""

from __future__ import annotations

import datetime
import random
import time

import pytest

from turnrl.models import tiny_tokenizer
from turnrl.rollout import ChatFormat, TemplateError

# A Qwen-2.5-style template written for these tests: tools in the system block, consecutive
# tool results grouped into one user turn of <tool_response> blocks, a default system prompt.
QWEN_STYLE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\\n\\n# Tools\\n\\nYou may call functions. Their signatures, in <tools></tools>:"
    "\\n<tools>' }}{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nReturn each call as <tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or (m.role == 'system' and not loop.first) or m.role == "
    "'assistant' %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user"
    "{% endif %}{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# A Llama-3.1-style template written for these tests: a fixed default date, JSON calls with
# "parameters", tool results under an ipython header.
LLAMA_STYLE = (
    "{% if date_string is not defined %}{% set date_string = '26 Jul 2024' %}{% endif %}"
    "{% if messages[0].role == 'system' %}{% set system = messages[0].content %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December "
    "2023\\nToday Date: ' + date_string + '\\n\\n' }}"
    "{% if tools %}{{ 'Respond with a JSON object {\"name\": function name, \"parameters\": "
    "dictionary of arguments}.\\n' }}{% for t in tools %}{{ t | tojson }}{{ '\\n' }}"
    "{% endfor %}{% endif %}{{ system + '<|im_end|>' }}"
    "{% for m in messages %}{{ '<|start_header_id|>' + ('ipython' if m.role == 'tool' else "
    "m.role) + '<|end_header_id|>\\n\\n' + m.content + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# The same with Llama-3.2's default date: today's, from the clock.
LLAMA_TODAY = LLAMA_STYLE.replace("'26 Jul 2024'", "strftime_now('%d %b %Y')")

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ CONTENT }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml(content: str = "m.content", before: str = "") -> str:
    """ChatML (no tool role) with each message's content rendered as ``content``."""
    return before + CHATML.replace("{{ CONTENT }}", "{{ " + content + " }}")


def qwen(rewrite_tool: str = "m.content", rewrite_assistant: str = "m.content") -> str:
    """QWEN_STYLE with a tool result's / an assistant turn's content rendered otherwise."""
    tool = QWEN_STYLE.replace("'\\n<tool_response>\\n' + m.content",
                              "'\\n<tool_response>\\n' + (" + rewrite_tool + ")")
    return tool.replace("m.role + '\\n' + m.content", "m.role + '\\n' + ((" + rewrite_assistant
                        + ") if m.role == 'assistant' else m.content)")


EARLIER = "(loop.revindex > 2)"  # an earlier message: not the last two

REFUSED = {
    # by length: only long contents in earlier turns are rewritten
    "truncates long tool results": (
        qwen(rewrite_tool=f"m.content[:4000] + ' [truncated]' if {EARLIER} and "
                          "m.content | length > 4000 else m.content"),
        "a long tool result"),
    "truncates long user messages (results as user turns)": (
        chatml(f"m.content[:3000] if m.role == 'user' and {EARLIER} and m.content | length > "
               "3000 else m.content"),
        "a long user message"),
    "trims long assistant turns": (
        chatml(f"m.content | trim if m.role == 'assistant' and {EARLIER} and "
               "m.content | length > 2000 else m.content"),
        "a long assistant turn"),
    # by position: only after k turns, or only older tool calls
    "drops the first messages once the conversation passes 60,000 characters": (
        "{% set ns = namespace(total=0) %}{% for m in messages %}"
        "{% set ns.total = ns.total + m.content | length %}{% endfor %}"
        + CHATML.replace("{% for m in messages %}", "{% for m in messages %}"
                         "{% if not (ns.total > 60000 and loop.index0 < 2) %}"
                         ).replace("{% endfor %}", "{% endif %}{% endfor %}"
                                   ).replace("{{ CONTENT }}", "{{ m.content }}"),
        "a long history"),
    "keeps a window of the last 30 messages": (
        CHATML.replace("{% for m in messages %}", "{% for m in messages[-30:] %}"
                       ).replace("{{ CONTENT }}", "{{ m.content }}"),
        "many turns"),
    "shortens turns older than 25 messages": (
        chatml("m.content[:3] if loop.revindex > 25 else m.content"),
        "many turns"),
    "drops tool calls older than 12 messages": (
        qwen(rewrite_assistant="'[called a tool]' if '<tool_call>' in m.content and "
                               "loop.revindex > 12 else m.content"),
        "many tool calls over many turns"),
    "folds all but the last of several results once the turn is over": (
        qwen(rewrite_tool="m.content if loop.last or messages[loop.index0 + 1].role != 'tool' "
                          "or loop.revindex <= 4 else '(folded)'"),
        "several tools called in one turn"),
}

CLOCK_OR_RANDOM = {
    "system prompt with today's date": (
        chatml(before="<|im_start|>system\nToday is {{ strftime_now('%d %B %Y') }}.<|im_end|>"
                      "\n"), "renders the date or time"),
    "system prompt with the time to the second": (
        chatml(before="{{ strftime_now('%H:%M:%S') }}\n"), "renders the date or time"),
    "a greeting only past midnight": (
        chatml(before="{% if strftime_now('%H') == '00' %}Up late?\n{% endif %}"),
        "renders the date or time"),
    "a note only on the first of the month": (
        chatml(before="{% if strftime_now('%d') == '01' %}New month.\n{% endif %}"),
        "renders the date or time"),
    "Llama-3.2-style default date from the clock": (LLAMA_TODAY, "renders the date or time"),
    "the date only next to the tools": (
        QWEN_STYLE.replace("<tools>' }}", "<tools>' }}{{ '(as of ' + strftime_now('%Y-%m') "
                                          "+ ')' }}"), "renders the date or time"),
    "a random conversation id": (
        chatml(before="<|im_start|>system\nid {{ range(100000) | random }}<|im_end|>\n"),
        "uses random numbers"),
    "random filler text": (chatml(before="{{ lipsum(1, False, 3, 5) }}\n"),
                           "uses random numbers"),
}


def _chat(template: str | None) -> ChatFormat:
    tok = tiny_tokenizer()
    if template is not None:
        tok.chat_template = template
    return ChatFormat(tok)


@pytest.mark.parametrize("variant", sorted(REFUSED))
def test_a_template_rewriting_history_by_length_or_position_is_refused_with_its_cause(variant):
    template, cause = REFUSED[variant]
    with pytest.raises(TemplateError, match=f"rewrites earlier turns of a conversation with "
                                            f"{cause}") as refused:
        _chat(template).check()
    assert "--model.chat_template" in str(refused.value)
    assert "plain text" not in str(refused.value)


@pytest.mark.parametrize("variant", sorted(CLOCK_OR_RANDOM))
def test_a_template_depending_on_the_clock_or_random_state_is_refused_with_its_cause(variant):
    template, cause = CLOCK_OR_RANDOM[variant]
    assert template.count("strftime_now") + template.count("random") + template.count(
        "lipsum") == 1  # the variant really has its one source of change
    with pytest.raises(TemplateError, match=cause) as refused:
        _chat(template).check()
    message = str(refused.value)
    assert "--model.chat_template" in message and "rewrites earlier assistant" not in message


def test_each_refused_template_really_breaks_a_rollout_of_that_shape():
    """The refusals are not false alarms: the length variant breaks the prefix on the long
    result it was refused for, the clock variant breaks it when the date changes."""
    from turnrl.rollout import chat as chat_module
    chat = _chat(REFUSED["truncates long tool results"][0])
    kind, turns = next(s for s in chat_module.SHAPES if s[0].startswith("a long tool result"))
    with pytest.raises(TemplateError, match="preserve the conversation prefix"):
        chat._check_shape(kind, turns)  # noqa: SLF001
    chat = _chat(CLOCK_OR_RANDOM["system prompt with today's date"][0])
    with chat_module._fixed_clock_and_random(datetime.datetime(2030, 5, 1, 23, 59), 0):
        messages, rendered, _ = chat.start("Hi")
    with chat_module._fixed_clock_and_random(datetime.datetime(2030, 5, 2, 0, 1), 0):
        with pytest.raises(TemplateError, match="preserve the conversation prefix"):
            chat.continue_after(messages, rendered, "Hello", True, "Bye")


@pytest.mark.parametrize("name", ["tiny ChatML", "Qwen style", "Llama style"])
def test_real_templates_pass(name):
    template = {"tiny ChatML": None, "Qwen style": QWEN_STYLE, "Llama style": LLAMA_STYLE}[name]
    chat = _chat(template)
    assert chat.tool_role == (name != "tiny ChatML")  # the tool shapes ran as tool messages
    chat.check()


@pytest.mark.slow
def test_smollm2s_own_template_passes_in_a_fraction_of_a_second():
    from transformers import AutoTokenizer

    from turnrl.models import model_directory
    tok = AutoTokenizer.from_pretrained(model_directory("smollm2-135m-instruct"),
                                        local_files_only=True)
    chat = ChatFormat(tok)
    started = time.process_time()
    chat.check()
    assert time.process_time() - started < 2.0  # ~0.02 s CPU measured; loose for CI


def test_the_probe_leaves_the_clock_and_random_state_as_they_were():
    from transformers.utils import chat_template_utils
    random.seed(7)
    expected = [random.random() for _ in range(3)]
    random.seed(7)
    _chat(QWEN_STYLE).check()
    assert [random.random() for _ in range(3)] == expected
    assert chat_template_utils.datetime is datetime.datetime


def test_the_probe_is_cheap_at_start_up():
    chat = _chat(QWEN_STYLE)
    started = time.process_time()
    for _ in range(3):
        chat.check()
    assert (time.process_time() - started) / 3 < 1.0  # ~0.03 s CPU measured


def test_a_template_refusing_the_system_role_is_probed_without_one():
    """Gemma-style: the template raises for a system message; the probe must not refuse it
    for that (rollouts without a system prompt work), and still checks everything else."""
    refuses_system = ("{% if messages[0].role == 'system' %}"
                      "{{ raise_exception('System role not supported') }}{% endif %}" + CHATML
                      ).replace("{{ CONTENT }}", "{{ m.content }}")
    _chat(refuses_system).check()
    with pytest.raises(TemplateError, match="renders the date or time"):
        _chat("{{ strftime_now('%d') }}" + refuses_system).check()
