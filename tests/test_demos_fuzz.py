"""Seeded fuzzing of the readers of users' data files: demonstrations (``sft.data``), the mcp
env's tasks file and config YAML. Whatever the bytes (random, not UTF-8, a byte-order mark,
UTF-16, truncated, a huge line, NUL bytes, nesting past the recursion limit), a reader either
returns every row or raises its own error type with one line naming FILE:LINE and the fix:
never another exception, a hang, or a row silently dropped."""

from __future__ import annotations

import codecs
import json
import random
import re
import time

import pytest

from turnrl.config import ConfigError, load_config
from turnrl.datafile import DataFileError, text_lines
from turnrl.demos.data import DataError, read_demonstrations
from turnrl.envs.mcp_env import read_tasks
from turnrl.rollout.chat import TemplateError

CALL = {"id": "c1", "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "12 * 34"}'}}
ROWS = [
    {"messages": [{"role": "user", "content": "Say a digit."},
                  {"role": "assistant", "content": "7"}]},
    {"messages": [{"role": "system", "content": "Sé breve — 简洁 🙂"},
                  {"role": "user", "content": "What is 12 times 34?"},
                  {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "c1", "content": "408"},
                  {"role": "assistant", "content": "408"}],
     "tools": [{"type": "function", "function": {"name": "calculator", "parameters": {
         "type": "object", "properties": {"expression": {"type": "string"}},
         "required": ["expression"]}}}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "naïve "},
                                               {"type": "text", "text": "ünïcödé"}]},
                  {"role": "assistant", "content": "ok", "weight": 1}]},
]
GOOD = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in ROWS * 2).encode()
TASKS = "".join(json.dumps({"prompt": f"Wie viel ist {i}×{i}?", "answer": i * i,
                            "note": "ü"}, ensure_ascii=False) + "\n"
                for i in range(6)).encode()
CONFIG = b"run:\n  steps: 3\n  seed: 1\nalgo:\n  clip_high: 0.28\n"


def _demos(path):
    return read_demonstrations(path)


def _tasks(path):
    return read_tasks(str(path))


def _config(path):
    return load_config(str(path))


READERS = {"demos": (_demos, DataError), "tasks": (_tasks, ValueError),
           "config": (_config, ConfigError)}
GOOD_FILES = {"demos": GOOD, "tasks": TASKS, "config": CONFIG}


def _outcome(reader: str, path, data: bytes):
    """The reader's rows, or its error's message after checking it is the documented one:
    exactly the reader's error type, one line, naming the file (and FILE:LINE when it names
    a line at all), in bounded time and length."""
    path.write_bytes(data)
    read, error = READERS[reader]
    started = time.monotonic()
    try:
        return read(path)
    except error as err:
        message = str(err)
        assert type(err) is error or reader == "tasks" and type(err) is ValueError, repr(err)
        assert "\n" not in message and len(message) < 600, message
        # a config's key problem is named by its key (run.seed: expected int; unknown
        # config section 'o'), as on the command line
        assert str(path) in message or reader == "config" and re.search(
            r"^[a-z_]+\.[a-z_]+: |config (key|section) '", message), message
        return message
    finally:
        assert time.monotonic() - started < 30, f"{reader} took too long on {data[:80]!r}"


def _line_of(message: str, path) -> int | None:
    found = re.search(re.escape(str(path)) + r":(\d+)", message)
    return int(found.group(1)) if found else None


def _nonblank_lines(data: bytes) -> int:
    return sum(1 for line in data.split(b"\n") if line.strip())


@pytest.mark.parametrize("reader", list(READERS))
def test_random_bytes_are_read_or_refused_in_one_line(tmp_path, reader):
    rng = random.Random(58)
    for case in range(40):
        size = rng.choice([1, 7, 64, 600, 4000])
        alphabet = rng.choice([bytes(range(256)), b'{}[]":,\n 0123456789abcnrtu\\\xff\x00'])
        data = bytes(rng.choice(alphabet) for _ in range(size))
        got = _outcome(reader, tmp_path / f"{reader}-{case}.data", data)
        if isinstance(got, list):  # random bytes that happen to read: no row lost
            assert reader == "config" or len(got) == _nonblank_lines(data)


@pytest.mark.parametrize("reader", list(READERS))
def test_mutated_good_files_lose_no_row_and_name_the_line(tmp_path, reader):
    """A good file with a few bytes flipped, inserted, deleted or the file cut short: every
    row back, or the error names a line of the file."""
    rng = random.Random(580)
    good = GOOD_FILES[reader]
    for case in range(60):
        data = bytearray(good)
        kind = rng.choice(["flip", "insert", "delete", "truncate"])
        at = rng.randrange(len(data))
        if kind == "flip":
            data[at] = rng.randrange(256)
        elif kind == "insert":
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        elif kind == "delete":
            del data[at:at + rng.randint(1, 4)]
        else:
            del data[at:]
        path = tmp_path / f"{reader}-{case}.data"
        got = _outcome(reader, path, bytes(data))
        lines = data.count(b"\n") + 1
        if isinstance(got, str):
            line = _line_of(got, path)
            if line is None:  # a config's key problem, named by its key
                assert reader == "config", got
            else:
                assert 1 <= line <= lines, got
        elif reader != "config":
            assert len(got) == _nonblank_lines(bytes(data)), kind


@pytest.mark.parametrize("reader", list(READERS))
def test_a_byte_that_is_not_utf8_names_its_file_line_and_the_fix(tmp_path, reader):
    good = GOOD_FILES[reader]
    starts = [0] + [i + 1 for i, b in enumerate(good) if b == ord("\n")][:-1]
    for line, start in enumerate(starts, 1):
        end = good.index(b"\n", start)
        at = start + (end - start) // 2
        data = good[:at] + b"\xff" + good[at:]
        path = tmp_path / f"{reader}-{line}.data"
        message = _outcome(reader, path, data)
        assert f"{path}:{line}: byte 0xff at column {at - start + 1} (in bytes) is not UTF-8" \
            in message and "save the file as UTF-8" in message


@pytest.mark.parametrize("reader", list(READERS))
def test_a_utf8_byte_order_mark_is_accepted_and_utf16_refused(tmp_path, reader):
    good = GOOD_FILES[reader]
    plain = _outcome(reader, tmp_path / "plain.data", good)
    with_bom = _outcome(reader, tmp_path / "bom.data", codecs.BOM_UTF8 + good)
    if reader == "demos":
        plain, with_bom = ([(d.messages, d.tools) for d in demos] for demos in (plain, with_bom))
    assert with_bom == plain
    text = good.decode()
    for encoding, name in [("utf-16", "UTF-16"), ("utf-16-be", None), ("utf-32", "UTF-32")]:
        data = text.encode(encoding)
        if name is None:
            data = codecs.BOM_UTF16_BE + data
            name = "UTF-16"
        path = tmp_path / f"{encoding}.data"
        message = _outcome(reader, path, data)
        assert f"{path}:1: the file is {name}" in message and "save it as UTF-8" in message
    # UTF-16 without a mark: its NUL bytes make the first line invalid, and the error says so
    path = tmp_path / "utf16-no-bom.data"
    message = _outcome(reader, path, text.encode("utf-16-le"))
    assert f"{path}:1: " in message
    assert ("#x0000" if reader == "config" else "is the file UTF-16?") in message


@pytest.mark.parametrize("reader", ["demos", "tasks"])
def test_nul_bytes_nesting_and_json_python_lets_through_are_one_line_errors(tmp_path, reader):
    first = GOOD_FILES[reader].split(b"\n")[0] + b"\n"
    cases = [
        (first.replace(b'"', b'"\x00', 1), "not valid JSON"),
        (first[:-2] + b"\x00}\n", "not valid JSON"),
        (b"[" * 200_000 + b"\n", "nested too deeply"),
        (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "nested too deeply"),
        (b'{"prompt": NaN, "answer": Infinity, "messages": NaN}\n', "NaN is not a JSON value"),
        (b'{"prompt": 1, "answer": ' + b"9" * 5000 + b"}\n", "Exceeds the limit"),
        (b'{"prompt": "\\ud800", "answer": 1, "messages": "\\udfff"}\n', "half a UTF-16"),
    ]
    for number, (bad, expected) in enumerate(cases):
        path = tmp_path / f"{number}.jsonl"
        message = _outcome(reader, path, first + bad)
        assert f"{path}:2: " in message and expected in message, message


def test_deep_nesting_inside_tool_call_arguments_is_refused_with_its_field(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    row = json.loads(GOOD.split(b"\n")[1])
    row["messages"][2]["tool_calls"][0]["function"]["arguments"] = deep
    path = tmp_path / "deep.jsonl"
    message = _outcome("demos", path, json.dumps(row).encode() + b"\n")
    assert message.startswith(f"{path}:1: messages[2].tool_calls[0].function.arguments: "
                              "the JSON is nested too deeply")


def test_a_huge_line_is_read_whole_or_refused_naming_it(tmp_path):
    """Tens of MB on one line: a whole row is read as it is; the same row cut short is one
    line of error (not the line's content); a line past the limit is refused unread."""
    big = "x" * 24_000_000
    row = json.dumps({"messages": [{"role": "user", "content": big},
                                   {"role": "assistant", "content": "ok"}]}).encode()
    path = tmp_path / "huge.jsonl"
    got = _outcome("demos", path, GOOD + row + b"\n" + GOOD)
    assert len(got) == 2 * _nonblank_lines(GOOD) + 1
    assert got[len(ROWS) * 2].messages[0]["content"] == big
    message = _outcome("demos", path, GOOD + row[:-3] + b"\n")
    assert f"{path}:{len(ROWS) * 2 + 1}: not valid JSON" in message
    path.write_bytes(b"1\n" + b"y" * 5000 + b"\n")
    lines = text_lines(path, max_line_bytes=1000)
    assert next(lines) == (1, "1")
    with pytest.raises(DataFileError, match=rf"^{re.escape(str(path))}:2: the line is longer "
                                            r"than 1000 bytes; JSON Lines holds one record"):
        next(lines)


def test_mcp_tasks_and_config_keep_their_own_errors(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    message = _outcome("tasks", tasks, TASKS + b'{"prompt": "no answer"}\n')
    assert message == (f'mcp env: {tasks}:7: needs "prompt" and "answer"; write one '
                       '{"prompt": ..., "answer": ...} object a line')
    assert [t.answer for t in _outcome("tasks", tasks, TASKS)] == [i * i for i in range(6)]
    config = tmp_path / "config.yaml"
    message = _outcome("config", config, CONFIG + b"algo: [\n")
    assert message.startswith(f"config file {config}:") and "not valid YAML" in message
    message = _outcome("config", config, b"run:\n" + b"  " + b"[" * 5000 + b"\n")
    assert "config file" in message
    assert _outcome("config", config, codecs.BOM_UTF8 + CONFIG).run.steps == 3


def test_a_chat_template_file_is_utf8_with_its_bad_byte_named(tmp_path):
    from turnrl.models import tiny_tokenizer
    from turnrl.policy import use_chat_template

    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "chat.jinja"
    tok = tiny_tokenizer()
    path.write_bytes(codecs.BOM_UTF8 + template.encode())
    use_chat_template(tok, str(path))
    assert tok.chat_template == template
    rng = random.Random(5)
    for _ in range(10):
        data = bytearray((template + "\n{# é #}\n").encode())
        data[rng.randrange(len(data))] = rng.choice([0xff, 0xfe, 0xc3, 0x80])
        path.write_bytes(bytes(data))
        try:
            use_chat_template(tok, str(path))
        except TemplateError as err:
            message = str(err)
            assert message.startswith(f"--model.chat_template '{path}' line ") \
                and "\n" not in message
            assert "save the file as UTF-8" in message or "save it as UTF-8" in message
        else:  # the byte still made UTF-8 (0x80 after 0xc3): read as it is
            assert tok.chat_template == bytes(data).decode()
