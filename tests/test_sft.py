"""Supervised fine-tuning: conversations tokenised exactly as the turn loop tokenises a played
episode, refusals with reasons, the JSONL reader's one-line errors, training, resume."""

from __future__ import annotations

import json

import pytest
import torch
from test_rollout import ScriptedEngine
from test_tool_loop import NATIVE, _env, _hermes

from turnrl.envs import make_env
from turnrl.envs.tool_env import calculator
from turnrl.models import tiny_model, tiny_tokenizer
from turnrl.rollout import ChatFormat, Completion, SamplingParams, run_episodes, run_sync
from turnrl.sft.conversation import DemoError, conversation_episode, episode_conversation

# NATIVE (a Qwen-like template) that also renders OpenAI-style ``tool_calls`` itself, as
# Qwen's and Hermes' templates do: one <tool_call> block per call after the content.
WITH_TOOL_CALLS = NATIVE.replace(
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>",
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>")


class RestrictedEngine:
    """The tiny model sampling for real, restricted to printable ASCII and its end of turn (a
    random model otherwise writes stray UTF-8 bytes no text re-encodes to)."""

    def __init__(self, model, tokenizer, seed=0):
        self.model, self.version = model, 0
        allowed = [tokenizer.convert_tokens_to_ids(c) for c in map(chr, range(32, 127))]
        self.bias = torch.full((len(tokenizer),), float("-inf"))
        self.bias[allowed] = 0.0
        self.bias[tokenizer.eos_token_id] = 2.0  # replies end by themselves, mostly
        self.eos = tokenizer.eos_token_id
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            ids = []
            for _ in range(params.max_new_tokens):
                logits = self.model(torch.tensor([list(prompt) + ids])).logits[0, -1]
                token = int(torch.multinomial(torch.softmax(logits + self.bias, -1), 1,
                                              generator=self.generator))
                ids.append(token)
                if token == self.eos:
                    break
            stopped = ids[-1] == self.eos
            out.append(Completion(ids, [0.0] * len(ids), "stop" if stopped else "length"))
        return out


def _chat(template: str | None = None) -> ChatFormat:
    tok = tiny_tokenizer()
    if template:
        tok.chat_template = template
    return ChatFormat(tok)


def _same(replayed, played) -> None:
    assert replayed.token_ids == played.token_ids
    assert replayed.loss_mask == played.loss_mask
    assert [(t.start, t.end, t.action) for t in replayed.turns] == [
        (t.start, t.end, t.action) for t in played.turns]


def test_episodes_the_tiny_model_played_retokenise_to_the_same_ids_and_mask():
    model, tok = tiny_model(seed=0)
    chat = ChatFormat(tok)
    engine = RestrictedEngine(model, tok)
    params = SamplingParams(24, 1.0, stop_token_ids=(chat.end_of_turn,))
    episodes = run_sync(run_episodes(lambda: make_env("say-digit", turns=3),
                                     [(i, i) for i in range(6)], engine, chat, params,
                                     max_turns=3))
    stopped = [ep for ep in episodes if all(t.finish_reason == "stop" for t in ep.turns)]
    assert len(stopped) >= 3 and sum(len(ep.turns) for ep in stopped) >= 9
    for played in stopped:
        messages = episode_conversation(chat, played, None, "Say a digit.")
        _same(conversation_episode(chat, messages), played)


@pytest.mark.parametrize("replies", [
    ["4", " 6 ", "Line one\n\n  na\u00efve \u2014 10% & <b>x</b> \U0001f642\n"],
    ["<think>2 and 2.</think>The answer: 4", "\n", "x" * 40],
])
def test_scripted_replies_with_awkward_text_retokenise_exactly(replies):
    chat = _chat()
    engine = ScriptedEngine(chat.tokenizer, replies)
    played, = run_sync(run_episodes(lambda: make_env("say-digit", turns=3), [(0, 0)], engine,
                                    chat, SamplingParams(max_new_tokens=64), max_turns=3))
    assert len(played.turns) == 3
    _same(conversation_episode(chat, episode_conversation(chat, played, None, "Say a digit.")),
          played)


def test_a_tool_episode_retokenises_from_tool_messages_and_from_openai_tool_calls():
    """The loop's tool episode (the call written as text, the result a tool message) and the
    same conversation in OpenAI form (``tool_calls`` + ``tool_call_id``) give the same ids."""
    chat = _chat(WITH_TOOL_CALLS)
    engine = ScriptedEngine(chat.tokenizer, [_hermes("12 * 34"), "408"])
    played, = run_sync(run_episodes(_env, [(0, 0)], engine, chat,
                                    SamplingParams(max_new_tokens=64), max_turns=3))
    assert played.success and len(played.turns) == 2
    tools = [calculator.schema()]
    as_text = [{"role": "system", "content": "Use the calculator."},
               {"role": "user", "content": "What is 12 times 34?"},
               {"role": "assistant", "content": _hermes("12 * 34")},
               {"role": "tool", "name": "calculator", "content": "408"},
               {"role": "assistant", "content": "408"}]
    _same(conversation_episode(chat, as_text, tools), played)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "12 * 34"}'}}
    openai = as_text[:2] + [{"role": "assistant", "content": None, "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "call_1", "content": "408"},
                            as_text[4]]
    assert conversation_episode(chat, openai, tools).token_ids == played.token_ids


def test_loss_mask_covers_the_replies_and_their_end_of_turn_only():
    chat = _chat()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Ciao"}, {"role": "user", "content": "!"}]
    episode = conversation_episode(chat, messages)
    trained = [i for i, m in enumerate(episode.loss_mask) if m]
    text = chat.tokenizer.decode([episode.token_ids[i] for i in trained])
    assert text == "Hello<|im_end|>Ciao<|im_end|>"
    # the trailing user message is left out: a played episode ends with the last reply
    assert chat.tokenizer.decode(episode.token_ids).endswith("assistant\nCiao<|im_end|>")
    assert chat.tokenizer.decode(episode.token_ids) == chat.render(messages[:5], False)[:-1]


STRIPS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DROPS_EARLY_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not "
    "loop.last %}{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_END = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, messages, reason", [
    (STRIPS, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " 6 "}],
     "does not render assistant message messages[1] as its content"),
    (DROPS_EARLY_THINKING, [{"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "<think>x</think>4"},
                            {"role": "user", "content": "ok"},
                            {"role": "assistant", "content": "5"}],
     "rewrites the conversation up to assistant message messages[1]"),
    (NO_END, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "4"}],
     "without its end-of-turn token"),
    (None, [{"role": "user", "content": "Hi"}], "no assistant message"),
    (None, [{"role": "assistant", "content": "4"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "4"}], "answers no user message"),
    (None, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "4"},
            {"role": "assistant", "content": "5"}], "both assistant messages"),
    (None, [{"role": "user", "content": "Hi"}, {"role": "system", "content": "x"},
            {"role": "assistant", "content": "4"}], "a system message at messages[1]"),
    (None, [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "assistant", "content": "1"}], "has no tool role"),
])
def test_conversations_the_template_cannot_render_exactly_are_refused_with_the_reason(
        template, messages, reason):
    with pytest.raises(DemoError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        conversation_episode(_chat(template), messages)


def test_tools_with_a_template_that_renders_none_are_refused():
    with pytest.raises(DemoError, match="renders no tools"):
        conversation_episode(_chat(), [{"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": "4"}],
                             [calculator.schema()])


def test_a_template_that_drops_tool_calls_is_refused():
    chat = _chat(NATIVE)  # tools and tool messages, but no rendering of ``tool_calls``
    call = {"id": "c", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": "1"})}}
    with pytest.raises(DemoError, match=r"drops the tool call\(s\) \['calculator'\]"):
        conversation_episode(chat, [{"role": "user", "content": "1?"},
                                    {"role": "assistant", "content": "", "tool_calls": [call]},
                                    {"role": "tool", "tool_call_id": "c", "content": "1"},
                                    {"role": "assistant", "content": "1"}],
                             [calculator.schema()])


# ---- the JSONL reader -----------------------------------------------------------------------

GOOD = {"messages": [{"role": "user", "content": "Say a digit."},
                     {"role": "assistant", "content": "7"}]}
CALL = {"id": "c1", "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}


def _rows(tmp_path, *lines: str):
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _bad_message(message, before=()) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "q"}, *before, message]})


@pytest.mark.parametrize("line, where, message", [
    ('{"messages": [', ":2:", "not valid JSON"),
    ('[1, 2]', ":2:", "a row must be a JSON object, got a list"),
    ('{"conversation": []}', ":2:", "messages: missing"),
    ('{"messages": []}', ":2:", "messages: must be a non-empty list"),
    ('{"messages": "hi"}', ":2:", "messages: must be a non-empty list of messages, got a string"),
    (_bad_message("hi"), ":2:", "messages[1]: must be an object"),
    (_bad_message({"role": "bot", "content": "x"}), ":2:",
     "messages[1].role: 'bot' is not one of system, user, assistant, tool"),
    (_bad_message({"content": "x"}), ":2:", "messages[1].role: missing"),
    (_bad_message({"role": "assistant", "content": 7}), ":2:",
     "messages[1].content: must be a string"),
    (_bad_message({"role": "assistant"}), ":2:", "messages[1].content: must be a string"),
    (_bad_message({"role": "assistant", "content": [{"type": "image_url"}]}), ":2:",
     "messages[1].content: must be a string"),
    (_bad_message({"role": "assistant", "content": None,
                   "tool_calls": [{k: v for k, v in CALL.items() if k != "id"}]}), ":2:",
     "messages[1].tool_calls[0].id: missing"),
    (_bad_message({"role": "assistant", "content": None,
                   "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]}), ":2:",
     "messages[1].tool_calls[0].function.name: missing"),
    (_bad_message({"role": "assistant", "content": None,
                   "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{1"}}]}),
     ":2:", "messages[1].tool_calls[0].function.arguments: not valid JSON"),
    (_bad_message({"role": "assistant", "content": None, "tool_calls": CALL}), ":2:",
     "messages[1].tool_calls: must be a list"),
    (_bad_message({"role": "tool", "content": "2"},
                  [{"role": "assistant", "content": None, "tool_calls": [CALL]}]), ":2:",
     "messages[2].tool_call_id: missing"),
    (_bad_message({"role": "tool", "tool_call_id": "zz", "content": "2"},
                  [{"role": "assistant", "content": None, "tool_calls": [CALL]}]), ":2:",
     "messages[2].tool_call_id: 'zz' answers no earlier tool call"),
    (json.dumps({**GOOD, "tools": [{"type": "function"}]}), ":2:",
     "tools[0].function.name: missing"),
])
def test_a_malformed_row_is_one_line_naming_the_file_line_and_field(tmp_path, line, where,
                                                                    message):
    from turnrl.sft.data import DataError, read_demonstrations

    path = _rows(tmp_path, json.dumps(GOOD), line, json.dumps(GOOD))
    with pytest.raises(DataError) as err:
        read_demonstrations(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}{where} ") and message in text


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_file_says_so(tmp_path, content):
    from turnrl.sft.data import DataError, read_demonstrations

    path = tmp_path / "demos.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match="no conversations"):
        read_demonstrations(path)
    with pytest.raises(DataError, match="is not a file"):
        read_demonstrations(tmp_path / "missing.jsonl")


def test_rows_come_back_normalised(tmp_path):
    from turnrl.sft.data import read_demonstrations

    tool_row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "1+"},
                                                          {"type": "text", "text": "1?"}]},
                             {"role": "assistant", "content": None, "tool_calls": [CALL]},
                             {"role": "tool", "tool_call_id": "c1", "content": "2"},
                             {"role": "assistant", "content": "2"}],
                "tools": [calculator.schema()]}
    path = _rows(tmp_path, json.dumps(GOOD), "", json.dumps(tool_row))
    first, second = read_demonstrations(path)
    assert first.where == f"{path}:1" and first.tools is None
    assert second.where == f"{path}:3" and second.tools == [calculator.schema()]
    assert second.messages[0]["content"] == "1+1?"
    assert second.messages[1]["content"] == ""
    assert second.messages[2]["name"] == "calculator"
