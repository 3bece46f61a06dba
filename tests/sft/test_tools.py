"""Tool-call demonstrations (OpenAI format: ``tool_calls``, ``tool`` messages, ``tools``) render
exactly as the turn loop renders that model's tool turns: the fallback format where the
template has no tools (SmolLM2, the tiny model), the template's own where it has them; and
``turnrl sft`` trains on them."""

from __future__ import annotations

import json

import pytest

from tests.rollout.test_rollout import ScriptedEngine
from tests.sft.test_sft import TINY, _same
from turnrl.demos.conversation import conversation_episode
from turnrl.demos.data import parse_row, read_demonstrations
from turnrl.envs.tool_env import Task, ToolEnv, calculator, multiplication_task
from turnrl.models import tiny_tokenizer
from turnrl.rewards import integer_match
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import SamplingParams
from turnrl.tools import render_call

# Qwen-2.5-like, written here: tools in the system turn, an assistant's ``tool_calls`` as one
# <tool_call> block each after its content, a run of tool messages as <tool_response> blocks
# in one user turn. (Hugging Face renders with trim_blocks: a newline right after a tag is
# written as {{ '\n' }}.)
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}"
    "{{ messages[0].content }}\n\n{% endif %}# Tools\n<tools>{% for t in tools %}\n"
    "{{ t | tojson }}{% endfor %}\n</tools>\nFor each call write <tool_call>\n"
    "{\"name\": <name>, \"arguments\": <object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

INSTRUCTIONS = "Use the calculator, then reply with the number."
CALLS = [("12 * 34", "408"), ("408 + 1", "409")]
PREAMBLE = "Let me compute that."


def _env() -> ToolEnv:
    return ToolEnv(lambda seed: Task("What is 12 times 34, plus 1?", 409), [calculator],
                   lambda reply, answer: integer_match(reply, answer, which="last"),
                   instructions=INSTRUCTIONS)


def _call(i: int, expression: str) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "calculator",
                         "arguments": json.dumps({"expression": expression})}}


def _openai_row() -> str:
    """The episode as an OpenAI-format JSONL row: two calls in one reply (after some text),
    their results as two tool messages, then the answer."""
    messages = [{"role": "system", "content": INSTRUCTIONS},
                {"role": "user", "content": "What is 12 times 34, plus 1?"},
                {"role": "assistant", "content": PREAMBLE,
                 "tool_calls": [_call(i, e) for i, (e, _) in enumerate(CALLS)]},
                *({"role": "tool", "tool_call_id": f"call_{i}", "content": result}
                  for i, (_, result) in enumerate(CALLS)),
                {"role": "assistant", "content": "409"}]
    return json.dumps({"messages": messages, "tools": [calculator.schema()]})


def _played(chat: ChatFormat):
    """The same episode through the real turn loop: a scripted player writes the calls as
    text (in the format the env parses), the env runs them."""
    calls = [render_call("calculator", {"expression": e}) for e, _ in CALLS]
    engine = ScriptedEngine(chat.tokenizer, ["\n".join([PREAMBLE, *calls]), "409"])
    played, = run_sync(run_episodes(_env, [(0, 0)], engine, chat,
                                    SamplingParams(max_new_tokens=256), max_turns=3))
    assert played.success and played.status == "done" and len(played.turns) == 2
    assert played.info["tool_calls"] == 2 and played.info["malformed_calls"] == 0
    return played


def _smollm2_chat() -> ChatFormat:
    from transformers import AutoTokenizer

    from turnrl.models import model_directory
    return ChatFormat(AutoTokenizer.from_pretrained(model_directory("smollm2-135m-instruct"),
                                                    local_files_only=True))


def _chat(name: str) -> ChatFormat:
    if name == "smollm2":
        return _smollm2_chat()
    tok = tiny_tokenizer()
    if name == "qwen-like":
        tok.chat_template = QWEN_LIKE
    return ChatFormat(tok)


@pytest.mark.parametrize("name", ["tiny", "smollm2", "qwen-like"])
def test_a_tool_call_demonstration_tokenises_as_the_turn_loop_plays_it(name):
    chat = _chat(name)
    assert (chat.native_tools, chat.tool_role) == (
        ("hermes", True) if name == "qwen-like" else (None, False))
    chat.check()  # a template the turn loop accepts
    demo = parse_row(_openai_row(), "demos.jsonl:1")  # the reader's own normalising
    played = _played(chat)
    replayed = conversation_episode(chat, demo.messages, demo.tools)
    _same(replayed, played)
    text = chat.tokenizer.decode(replayed.token_ids)
    trained = chat.tokenizer.decode([t for t, m in zip(replayed.token_ids, replayed.loss_mask,
                                                       strict=True) if m])
    assert trained.startswith(PREAMBLE + "\n<tool_call>\n") and trained.endswith("409<|im_end|>")
    assert "<tool_response>" not in trained and "# Tools" not in trained
    if chat.native_tools is None:  # the fallback, as the env teaches it in its system prompt
        assert text.count(INSTRUCTIONS) == 1 and "You can call these tools" in text
        assert text.count("<tool_response>\n{") == 2 and '"content": "409"' in text
    else:  # the template's own tools block and tool turns
        assert "# Tools" in text and "You can call these tools" not in text


def test_a_template_with_tools_but_no_tool_role_gets_results_as_one_user_message():
    """The third way the loop plays tools: the template shows the tools and its calls, but
    renders no tool message; the results go back as the observation, a user message."""
    no_tool_role = QWEN_LIKE.replace("{%- if m.role == 'tool' %}", "{%- if false %}")
    tok = tiny_tokenizer()
    tok.chat_template = no_tool_role.replace("{%- elif m.role != 'system' %}",
                                             "{%- elif m.role in ('user', 'assistant') %}")
    chat = ChatFormat(tok)
    assert chat.native_tools == "hermes" and not chat.tool_role
    demo = parse_row(_openai_row(), "demos.jsonl:1")
    _same(conversation_episode(chat, demo.messages, demo.tools), _played(chat))


def test_fallback_tools_without_schemas_and_calls_without_tools_render():
    """A row with calls but no ``tools`` keeps its own system prompt (it may describe the
    tools itself); a schema without ``required`` or ``properties`` is listed as given."""
    chat = _chat("tiny")
    row = json.loads(_openai_row())
    bare = parse_row(json.dumps({"messages": row["messages"]}), "f:1")
    episode = conversation_episode(chat, bare.messages, bare.tools)
    text = chat.tokenizer.decode(episode.token_ids)
    assert "You can call these tools" not in text and text.count("<tool_call>") == 2
    schema = {"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object"}}}
    loose = parse_row(json.dumps({"messages": row["messages"], "tools": [schema]}), "f:1")
    text = chat.tokenizer.decode(conversation_episode(chat, loose.messages, loose.tools).token_ids)
    assert json.dumps(schema | {"function": {"name": "calculator", "description": "",
                                             "parameters": {"type": "object"}}}) in text


def _tool_rows(path, count: int):
    """``count`` tool-arithmetic demonstrations in OpenAI format (the task's call, its
    result, the product), as a recorder of an agent would write them."""
    rows = []
    for seed in range(count):
        task = multiplication_task(seed, 10, 99)
        (name, arguments), = task.calls
        messages = [{"role": "user", "content": task.prompt},
                    {"role": "assistant", "content": None, "tool_calls": [{
                        "id": "c", "type": "function",
                        "function": {"name": name, "arguments": json.dumps(arguments)}}]},
                    {"role": "tool", "tool_call_id": "c",
                     "content": calculator.fn(**arguments)},
                    {"role": "assistant", "content": str(task.answer)}]
        rows.append(json.dumps({"messages": messages, "tools": [calculator.schema()]}))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_smollm2_takes_every_tool_call_row(tmp_path):
    from turnrl.sft.train import tokenise

    chat = _smollm2_chat()
    demos = read_demonstrations(_tool_rows(tmp_path / "tools.jsonl", 6))
    episodes, skipped = tokenise(chat, demos, skip_unfit=True, max_tokens=2048)
    assert skipped == [] and len(episodes) == 6
    for episode in episodes:
        trained = chat.tokenizer.decode([t for t, m in zip(episode.token_ids, episode.loss_mask,
                                                           strict=True) if m])
        assert trained.startswith('<tool_call>\n{"name": "calculator", "arguments": ')
        assert trained.endswith(f"{episode.turns[-1].action}<|im_end|>")


def test_sft_trains_the_tiny_model_on_tool_call_demonstrations(tmp_path):
    from turnrl.config import load_config
    from turnrl.sft.train import sft

    data = _tool_rows(tmp_path / "tools.jsonl", 16)
    cfg = load_config(None, TINY + ["--sft.data", str(data), "--run.out_dir",
                                    str(tmp_path / "sft"), "--run.steps", "6",
                                    "--optim.lr", "1e-2", "--sft.batch_size", "4",
                                    "--sft.eval_fraction", "0.25"])
    result = sft(cfg)
    assert result.skipped == 0
    assert result.train_conversations == 12 and result.held_out_conversations == 4
    assert result.loss_after < result.loss_before - 1.0  # nats per assistant token
