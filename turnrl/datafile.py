"""Reading the text files users hand TurnRL (demonstrations, tasks, configs): every problem one
line naming ``FILE:LINE``, what is wrong and the fix, never the decoder's own exception.

The bytes are decoded here, line by line, so that a byte that is not UTF-8 is reported with
its file and line (Python's decoder names neither). Encodings:

- UTF-8 is the format; a UTF-8 byte-order mark at the start (which Windows editors write) is
  accepted and dropped, as every JSON and YAML reader does;
- a UTF-16 or UTF-32 file is refused with the fix, save it as UTF-8 (recognised by its
  byte-order mark; without one, its NUL bytes make the JSON invalid, and the error says so);
- any other byte that is not UTF-8 is refused naming its line, its column (in bytes) and
  the byte.

A line longer than ``MAX_LINE_BYTES`` is refused without being read whole (a file with no
line breaks is not JSON Lines). JSON (``parse_json``) is Python's, with what it lets through
that is not JSON refused: ``NaN`` and ``Infinity``, nesting deeper than the interpreter can
parse (RecursionError), integers of more digits than Python converts, a ``\\ud800``-style
escape of half a UTF-16 pair (no character: nothing could encode or tokenise it).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MAX_LINE_BYTES = 256 * 1024 * 1024
"""The longest line read (256 MiB): tens of MB of one conversation is fine, more than any
model's context by far; the limit keeps a file with no line breaks from filling memory."""

_WIDE_BOMS = {codecs.BOM_UTF32_LE: "UTF-32", codecs.BOM_UTF32_BE: "UTF-32",
              codecs.BOM_UTF16_LE: "UTF-16", codecs.BOM_UTF16_BE: "UTF-16"}
"""UTF-32's little-endian mark starts with UTF-16's: the longer ones are tried first."""


class DataFileError(ValueError):
    """A user's data file that cannot be read; the message is one line: FILE:LINE, what, fix."""


def text_lines(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES
               ) -> Iterator[tuple[int, str]]:
    """(line number from 1, text without its line break) of each line of the UTF-8 file
    ``path``; raises ``DataFileError`` at the first line that cannot be read as text."""
    with open(path, "rb") as f:
        number = 0
        while raw := f.readline(max_line_bytes + 1):
            number += 1
            if number == 1:
                check_bom(raw, path)
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if len(raw) > max_line_bytes:
                raise DataFileError(
                    f"{path}:{number}: the line is longer than {max_line_bytes} bytes; JSON "
                    "Lines holds one record a line (is the file JSON Lines?)")
            yield number, decode(raw, f"{path}:{number}").rstrip("\r\n")


def read_text(path: str | Path) -> str:
    """The whole UTF-8 file ``path`` as text (a leading byte-order mark dropped); a byte that
    is not UTF-8 raises ``DataFileError`` naming its line."""
    raw = Path(path).read_bytes()
    check_bom(raw, path)
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        start = raw.rfind(b"\n", 0, err.start) + 1
        raise DataFileError(f"{path}:{line}: {_not_utf8(raw, err, err.start - start)}") from None


def check_bom(head: bytes, path: str | Path) -> None:
    """Refuse a file that starts with a UTF-16 or UTF-32 byte-order mark."""
    for bom, name in _WIDE_BOMS.items():
        if head.startswith(bom):
            raise DataFileError(f"{path}:1: the file is {name} (it starts with a {name} "
                                "byte-order mark); save it as UTF-8")


def decode(raw: bytes, where: str) -> str:
    """One line's bytes as text; ``where`` (FILE:LINE) starts the error."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataFileError(f"{where}: {_not_utf8(raw, err, err.start)}") from None


def _not_utf8(raw: bytes, err: UnicodeDecodeError, column: int) -> str:
    byte = raw[err.start]
    hint = " (NUL bytes: is the file UTF-16?)" if b"\x00" in raw else ""
    return (f"byte 0x{byte:02x} at column {column + 1} (in bytes) is not UTF-8 ({err.reason})"
            f"{hint}; save the file as UTF-8")


def parse_json(text: str, where: str) -> Any:
    """``text`` as JSON; anything that is not raises ``DataFileError`` starting with ``where``
    (FILE:LINE), one line: the problem and its column."""
    try:
        value = json.loads(text, parse_constant=_not_json_constant)
        if _SURROGATE_ESCAPE.search(text):
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        return value
    except json.JSONDecodeError as err:
        hint = " (NUL bytes: is the file UTF-16? save it as UTF-8)" if "\x00" in text else ""
        raise DataFileError(f"{where}: not valid JSON ({err.msg} at column {err.colno})"
                            f"{hint}") from None
    except RecursionError:
        raise DataFileError(f"{where}: the JSON is nested too deeply to read; flatten "
                            "it") from None
    except UnicodeEncodeError:
        raise DataFileError(f"{where}: a \\u escape names half a UTF-16 surrogate pair, "
                            "which is no character; write the character itself") from None
    except ValueError as err:  # NaN/Infinity (below), an integer of too many digits
        reason = str(err).splitlines()[0].split(";")[0][:200]
        raise DataFileError(f"{where}: not valid JSON ({reason})") from None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""An escape that may be half a surrogate pair (a whole pair decodes to one character)."""


def _not_json_constant(name: str):
    raise ValueError(f"{name} is not a JSON value; write a number or null")
