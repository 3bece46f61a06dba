"""Seeded fuzz of the chat-template boundary (``--model.chat_template FILE``): a file that is
not valid Jinja, raises while rendering, is empty, binary or not UTF-8, or is a valid
template cut or spliced at random, is either accepted (and then renders every probe) or
refused at start-up with one line naming the file and the fix; never a traceback."""

from __future__ import annotations

import random

import pytest

from turnrl.cli import main
from turnrl.rollout import ChatFormat, TemplateError
from turnrl.rollout.chat import checked_chat

CASES = 40
"""Randomly damaged templates."""

SPLICES = ["{%", "%}", "{{", "}}", "{% endfor %}", "{% if %}", "{{ raise_exception('no') }}",
           "{{ 1 / 0 }}", "{{ messages[99].content }}", "{{ nothing_here() }}",
           "{% for x in 3 %}{% endfor %}", "{{ messages | join }}", "\xff", "\x00", "{#",
           "{{ '%d' % 'x' }}", "{% set x = %}", "{{ messages[0].content.nope.deeper }}"]


def _damaged(template: str, rng: random.Random) -> bytes:
    """``template`` cut at a random offset, or with random fragments spliced in."""
    if rng.random() < 0.3:
        return template[:rng.randrange(len(template))].encode()
    text = template
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(text) + 1)
        text = text[:at] + rng.choice(SPLICES) + text[at:]
    data = text.encode()
    if "\xff" in text:  # a byte that is not UTF-8, as a file from another encoding has
        data = data.replace("\xff".encode(), b"\xff")
    return data


def _outcome(tok, path) -> ChatFormat | str:
    """What start-up does with the template file: its ``ChatFormat``, or the one-line
    refusal (asserted to name the file and the fix)."""
    own = tok.chat_template
    try:
        return checked_chat(tok, str(path))
    except TemplateError as err:
        message = str(err)
        assert "\n" not in message and len(message) < 1200, message
        assert f"--model.chat_template '{path}'" in message, message
        return message
    finally:
        tok.chat_template = own


@pytest.mark.parametrize("seed", range(CASES))
def test_a_randomly_damaged_template_is_accepted_whole_or_refused_in_one_line(tiny, tmp_path,
                                                                             seed):
    _, tok = tiny
    path = tmp_path / "chat.jinja"
    path.write_bytes(_damaged(tok.chat_template, random.Random(seed)))
    outcome = _outcome(tok, path)
    if isinstance(outcome, ChatFormat):  # accepted: it renders a conversation start to end
        messages, text, ids = outcome.start("What is 2+2?", "Be brief.")
        assert text and ids
        outcome.continue_after(messages, text, "4", True, "Thanks.")


@pytest.mark.parametrize(("data", "problem"), [
    (b"", "is empty"),
    (b"  \n\t\n", "is empty"),
    (b"\x00\x01\x02binary", "is binary"),
    (b"\xff\xfe{{ x }}", "line 1: the file is UTF-16 (it starts with a UTF-16 byte-order mark); "
                        "save it as UTF-8"),
    (b"{{ x }}\n{# \xe9 #}", "line 2: byte 0xe9 at column 4 (in bytes) is not UTF-8"),
    (b"{% for m in messages %}{{ m.content }", "is not valid Jinja (line 1: "),
    (b"{% for m in messages %}\n{{ m.content }}\n{% endfor", "is not valid Jinja (line 3: "),
    (b"{{ raise_exception('roles must alternate') }}",
     "fails to render a plain conversation (system, user and assistant turns): "
     "TemplateError: roles must alternate"),
    (b"{{ messages[7].content }}", "UndefinedError"),
    (b"{% for m in messages %}{{ m.content / 0 }}{% endfor %}", "TypeError"),
])
def test_a_bad_template_file_is_refused_naming_the_problem(tiny, tmp_path, data, problem):
    _, tok = tiny
    path = tmp_path / "chat.jinja"
    path.write_bytes(data)
    outcome = _outcome(tok, path)
    assert isinstance(outcome, str) and problem in outcome, outcome


def test_a_byte_order_mark_is_dropped_not_rendered(tiny, tmp_path):
    _, tok = tiny
    path = tmp_path / "chat.jinja"
    path.write_bytes(b"\xef\xbb\xbf" + tok.chat_template.encode())
    chat = _outcome(tok, path)
    assert isinstance(chat, ChatFormat) and "\ufeff" not in chat.start("Hi")[1]


def test_the_train_command_refuses_a_bad_template_in_one_line(tmp_path, capsys):
    path = tmp_path / "chat.jinja"
    path.write_text("{% if messages %}{{ messages[0].content }}")
    code = main(["train", "--model.name", "tiny", "--env.name", "say-digit", "--run.steps", "1",
                 "--model.chat_template", str(path), "--run.out_dir", str(tmp_path / "run"),
                 "--run.progress", "false", "--run.tensorboard", "false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "Traceback" not in err, err
    assert f"--model.chat_template '{path}' is not valid Jinja" in err
