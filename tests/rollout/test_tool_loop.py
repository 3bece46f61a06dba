"""Tool calls through the one turn loop: the model's own tool format where its template has
one (tools rendered by the template, results as ``tool`` messages), the fallback otherwise,
token bookkeeping exact in both, and the template check covering tool turns."""

from __future__ import annotations

import json

import pytest

from tests.rollout.test_rollout import ScriptedEngine
from turnrl.envs.tool_env import Task, ToolEnv, calculator
from turnrl.models import tiny_tokenizer
from turnrl.rewards import integer_match
from turnrl.rollout import ChatFormat, TemplateError, run_episodes, run_sync
from turnrl.samplers import SamplingParams

# A Qwen-like template written for these tests: tools in the system block, tool results
# wrapped in <tool_response> inside a user turn.
NATIVE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}"
    "{{ messages[0].content }}\n\n{% endif %}# Tools\n<tools>\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}</tools>\nCall one with <tool_call>\n{\"name\": <name>, "
    "\"arguments\": <object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Llama-3.1-like: tools as JSON with "parameters" in the first user turn, an ipython role.
LLAMA = (
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}"
    "<|end_header_id|>\n\n{% if loop.first and tools %}Respond with a JSON object {\"name\": "
    "function name, \"parameters\": dictionary of arguments}.\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}{% endif %}{{ m.content }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# Rewrites an earlier tool call once its result follows: breaks token-in-token-out.
REWRITES_CALLS = NATIVE.replace(
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}",
    "{% elif m.role == 'assistant' and loop.nextitem is defined and loop.nextitem.role == "
    "'tool' %}<|im_start|>assistant\n[called a tool]"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}")


def _chat(template: str | None) -> ChatFormat:
    tok = tiny_tokenizer()
    if template:
        tok.chat_template = template
    return ChatFormat(tok)


def _env() -> ToolEnv:
    return ToolEnv(lambda seed: Task("What is 12 times 34?", 408), [calculator],
                   lambda reply, answer: integer_match(reply, answer, which="last"),
                   instructions="Use the calculator.")


def _play(chat: ChatFormat, replies: list[str]):
    engine = ScriptedEngine(chat.tokenizer, replies)
    episodes = run_sync(run_episodes(_env, [(0, 0)], engine, chat,
                                     SamplingParams(max_new_tokens=64), max_turns=3))
    return episodes[0]


def _hermes(expression: str) -> str:
    return f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": expression}})}\n</tool_call>'  # noqa: E501


def _policy_text(chat: ChatFormat, episode) -> list[str]:
    ids, mask = episode.token_ids, episode.loss_mask
    runs, current = [], []
    for token, is_policy in zip(ids, mask, strict=True):
        if is_policy:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [chat.tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def test_native_template_gets_the_tools_and_tool_messages():
    chat = _chat(NATIVE)
    assert chat.native_tools == "hermes" and chat.tool_role
    chat.check()
    episode = _play(chat, [_hermes("12 * 34"), "408"])
    assert episode.success and episode.reward == 1.0 and len(episode.turns) == 2
    text = chat.tokenizer.decode(episode.token_ids, skip_special_tokens=False)
    # the template rendered the tools; the fallback prompt was not used
    assert '"name": "calculator"' in text and "You can call these tools" not in text
    assert text.startswith("<|im_start|>system\nUse the calculator.\n\n# Tools")
    # the result went back as a tool message, rendered by the template
    assert "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>" in text
    # token-in-token-out: the ids are exactly the template's render of the conversation
    messages = [{"role": "system", "content": "Use the calculator."},
                {"role": "user", "content": "What is 12 times 34?"},
                {"role": "assistant", "content": _hermes("12 * 34")},
                {"role": "tool", "name": "calculator", "content": "408"},
                {"role": "assistant", "content": "408"}]
    schemas = [calculator.schema()]
    assert chat.render(messages, False, schemas) == text + "\n"
    assert _policy_text(chat, episode) == [_hermes("12 * 34") + "<|im_end|>", "408<|im_end|>"]


def test_a_failed_call_goes_back_as_an_error_tool_message():
    chat = _chat(NATIVE)
    episode = _play(chat, [_hermes("12 * * 34"), "408"])
    text = chat.tokenizer.decode(episode.token_ids, skip_special_tokens=False)
    assert "<tool_response>\nerror: calculator raised SyntaxError" in text
    assert episode.info["tool_calls"] == 1 and episode.success  # a raising tool is not malformed


def test_llama_style_template_parses_its_own_json_calls():
    chat = _chat(LLAMA)
    assert chat.native_tools == "llama3-json"
    call = json.dumps({"name": "calculator", "parameters": {"expression": "12 * 34"}})
    episode = _play(chat, [call, "408"])
    text = chat.tokenizer.decode(episode.token_ids, skip_special_tokens=False)
    assert episode.success and episode.info["tool_calls"] == 1
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n408" in text


def test_template_without_tools_uses_the_fallback_prompt_and_a_user_turn():
    chat = _chat(None)  # plain ChatML, like SmolLM2's: no tools= support
    assert chat.native_tools is None and not chat.tool_role
    episode = _play(chat, [_hermes("12 * 34"), "408"])
    text = chat.tokenizer.decode(episode.token_ids, skip_special_tokens=False)
    assert episode.success
    assert "You can call these tools" in text and "<|im_start|>tool" not in text
    assert '<|im_start|>user\n<tool_response>\n{"name": "calculator", "content": "408"}' in text


def test_the_template_check_catches_a_template_that_rewrites_tool_calls():
    chat = _chat(REWRITES_CALLS)
    assert chat.tool_role
    with pytest.raises(TemplateError, match="a tool call answered by a tool message"):
        chat.check()
    with pytest.raises(TemplateError, match="preserve the conversation prefix"):
        _play(chat, [_hermes("12 * 34"), "408"])


def test_an_env_can_opt_out_of_native_tools():
    env = ToolEnv(lambda seed: Task("q", 1), [calculator], lambda r, answer: 0.0,
                  native_tools=False, fmt="hermes")
    system, tools = _chat(LLAMA).env_prompt(env)
    assert tools is None and system == env.system_prompt and env.fmt == "hermes"
