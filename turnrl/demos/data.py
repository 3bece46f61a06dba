"""Demonstration files: JSONL rows ``{"messages": [...], "tools": [...]}`` (OpenAI chat format).

Every row is checked before anything trains: a malformed one stops the run with one line
naming the file, the line and the field (``FILE:LINE: messages[2].tool_calls[0].id: ...``).
Rows come back normalised: text-part lists joined into strings, a tool message's ``name``
filled in from the call it answers (templates show it), blank lines skipped.

Two token-level kinds of row are read too, as they were written: an episode recorded by
``turnrl serve`` (``serve.record_dir``'s ``episodes.jsonl``: ``episode_id``, ``segments``,
``reward``) and a turn-loop ``Episode`` (a run's ``episodes/*.jsonl``, ``eval_*.jsonl``:
``token_ids``, ``loss_mask``, ``reward``). Their ids are trained as recorded.

A local Hugging Face dataset (``.parquet``, ``.arrow``, a ``save_to_disk`` directory) is read
row by row as its JSONL would be, ``FILE: row N`` naming a row. ``read_rows`` is that reader,
shared with ``turnrl rm``'s preference pairs (``turnrl/sft/preference.py``).

The bytes are read by ``turnrl.datafile``: UTF-8, a leading UTF-8 byte-order mark accepted
and dropped; a byte that is not UTF-8, a UTF-16 file, a line over ``MAX_LINE_BYTES``,
JSON that is truncated, nested too deeply or holds ``NaN`` are each one ``DataError`` line
naming ``FILE:LINE`` and the fix. No row is ever dropped: the first bad one stops the read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from turnrl.datafile import DataFileError, parse_json, text_lines
from turnrl.types import Episode, Turn

T = TypeVar("T")
ROLES = ("system", "user", "assistant", "tool")
ROW_FORMAT = 'one JSON object a line: {"messages": [{"role": ..., "content": ...}, ...]}'


class DataError(ValueError):
    """A malformed demonstration file; the message is one line: file, line, field, fix."""


@dataclass
class Demonstration:
    messages: list[dict]
    tools: list[dict] | None
    where: str
    """``FILE:LINE``, for messages about this row."""
    episodes: list[Episode] | None = None
    """A token-level row's sequences as recorded (``messages`` is then empty)."""
    reward: float | None = None
    """A token-level row's reward (None: none given)."""


DATASET_SUFFIXES = (".parquet", ".arrow")
"""Files read through Hugging Face ``datasets`` (as is a directory ``save_to_disk`` wrote)."""


def read_demonstrations(path: str | Path) -> list[Demonstration]:
    """Every row of ``path``, checked and normalised; raises ``DataError``. A JSONL file, or
    a local Hugging Face dataset (``DATASET_SUFFIXES`` or a ``save_to_disk`` directory)."""
    return read_rows(path, parse_row, option="sft.data", what="conversations",
                     row_format=ROW_FORMAT)


def read_rows(path: str | Path, parse: Callable[[Any, str], T], *, option: str, what: str,
              row_format: str) -> list[T]:
    """Every row of ``path`` through ``parse(row, where)``: a JSONL file's lines as parsed JSON
    (``where`` is ``FILE:LINE``) or a local Hugging Face dataset's rows (``DATASET_SUFFIXES``
    or a ``save_to_disk`` directory; ``where`` is ``FILE: row N`` from 1, the nulls Arrow
    fills in dropped). ``option`` (the setting that named the file), ``what`` (its rows) and
    ``row_format`` word the errors; ``turnrl sft`` and ``turnrl rm`` both read this way."""
    path = Path(path)
    if path.is_dir() or path.suffix in DATASET_SUFFIXES:
        rows = [parse(_drop_nulls(row), f"{path}: row {number}")
                for number, row in enumerate(dataset_rows(path, option), 1)]
        if not rows:
            raise DataError(f"{path}: no {what} (the dataset is empty)")
        return rows
    if not path.is_file():
        raise DataError(f"{option} '{path}' is not a file; pass a JSONL file of {what} "
                        f"({row_format}) or a local Hugging Face dataset")
    rows = []
    try:
        for number, line in text_lines(path):
            if line.strip():
                where = f"{path}:{number}"
                rows.append(parse(_json_row(line, where, row_format), where))
    except DataFileError as err:
        raise DataError(str(err)) from None
    except OSError as err:  # unreadable (permissions, a device error): name the file
        raise DataError(f"{option} '{path}': cannot be read ({err.strerror or err})") from None
    if not rows:
        raise DataError(f"{path}: no {what} (the file is empty); {row_format}")
    return rows


def _json_row(line: str, where: str, row_format: str):
    try:
        return parse_json(line, where)
    except DataFileError as err:
        raise DataError(f"{err}; {row_format}") from None


def dataset_rows(path: Path, option: str):
    """The rows of a local Hugging Face dataset (its "train" split when it has several), as
    dicts; ``DataError`` naming ``option``'s file when it cannot be read."""
    if not path.exists():
        raise DataError(f"{option} '{path}' does not exist")
    try:
        import datasets
    except ImportError:
        raise DataError(f"{option} '{path}' is a Hugging Face dataset: pip install datasets "
                        "(or convert it to JSONL)") from None
    try:
        if path.is_dir():
            data = datasets.load_from_disk(str(path))
        else:
            data = datasets.load_dataset(path.suffix[1:], data_files=str(path), split="train")
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds; name the file
        raise DataError(f"{option} '{path}': cannot be read as a dataset "
                        f"({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise DataError(f"{option} '{path}': no 'train' split (it has "
                            f"{', '.join(data)}); save the split to train on")
        data = data["train"]
    return data


def parse_row(line: str | dict, where: str) -> Demonstration:
    """One JSONL line (or a parsed row) as a ``Demonstration``; ``where`` (FILE:LINE)
    starts every error."""
    row = _json_row(line, where, ROW_FORMAT) if isinstance(line, str) else line
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {_kind(row)}; {ROW_FORMAT}")
    if "messages" not in row:
        if "segments" in row and "episode_id" in row:
            return recording_row(row, where)
        if "token_ids" in row and "loss_mask" in row:
            return episode_row(row, where)
        raise DataError(f"{where}: messages: missing; {ROW_FORMAT} (or a turnrl serve "
                        "recording, or a run's episode)")
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages: must be a non-empty list of messages, got "
                        f"{_kind(messages)}")
    tools = row.get("tools")
    if tools is not None:
        check_tools(tools, where)
    checked, calls = [], {}
    for i, message in enumerate(messages):
        checked.append(check_message(message, f"{where}: messages[{i}]", calls))
    return Demonstration(checked, tools or None, where)


def check_message(message, at: str, calls: dict[str, str]) -> dict:
    """One message, normalised; ``calls`` (id -> function name) collects the tool calls
    made so far, which a tool message must answer."""
    if not isinstance(message, dict):
        raise DataError(f"{at}: must be an object with 'role' and 'content', got {_kind(message)}")
    role = message.get("role")
    if role not in ROLES:
        got = "missing; it is" if role is None else f"{role!r} is not"
        raise DataError(f"{at}.role: {got} one of {', '.join(ROLES)}")
    out = dict(message)
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise DataError(f"{at}.tool_calls: only assistant messages make tool calls")
        check_tool_calls(tool_calls, at, calls)
    if "weight" in message and (role != "assistant" or message["weight"] not in (0, 1)
                                or isinstance(message["weight"], bool)):
        raise DataError(f"{at}.weight: {message['weight']!r}; only assistant messages take "
                        "a weight, 0 (context only) or 1 (trained)")
    content = message.get("content")
    if content is None and role == "assistant" and tool_calls:
        out["content"] = ""
    else:
        out["content"] = text_content(content, f"{at}.content")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise DataError(f"{at}.tool_call_id: missing; a tool message names the id of the "
                            "call it answers")
        if call_id not in calls:
            raise DataError(f"{at}.tool_call_id: {call_id!r} answers no earlier tool call")
        if not isinstance(message.get("name", ""), str):
            raise DataError(f"{at}.name: must be the called tool's name (text)")
        out["name"] = message.get("name") or calls[call_id]
    return out


def text_content(content, at: str) -> str:
    """A message's content as one string: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise DataError(f"{at}: must be a string (or a list of {{\"type\": \"text\", \"text\": ...}} "
                    f"parts), got {_kind(content)}")


def check_tool_calls(tool_calls, at: str, calls: dict[str, str]) -> None:
    """OpenAI tool calls: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``
    with ``arguments`` a JSON object (or its JSON text)."""
    if not isinstance(tool_calls, list):
        raise DataError(f"{at}.tool_calls: must be a list, got {_kind(tool_calls)}")
    for j, call in enumerate(tool_calls):
        here = f"{at}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise DataError(f"{here}: must be an object, got {_kind(call)}")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise DataError(f"{here}.id: missing; every tool call needs the id its tool "
                            "message answers")
        if call.get("type", "function") != "function":
            raise DataError(f"{here}.type: {call['type']!r}; only 'function' calls exist")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not function["name"]:
            raise DataError(f"{here}.function.name: missing; a call names its function")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = parse_json(arguments, f"{here}.function.arguments")
            except DataFileError as err:
                raise DataError(str(err)) from None
        if not isinstance(arguments, dict):
            raise DataError(f"{here}.function.arguments: must be a JSON object, got "
                            f"{_kind(arguments)}")
        calls[call["id"]] = function["name"]


def recording_row(row: dict, where: str) -> Demonstration:
    """An episode ``turnrl serve`` recorded: one ``Episode`` per segment (serve/record.py)."""
    segments = row["segments"]
    if not isinstance(segments, list) or not segments:
        raise DataError(f"{where}: segments: must be a non-empty list, got {_kind(segments)}")
    reward = _reward(row, where)
    episodes = []
    for k, segment in enumerate(segments):
        at = f"{where}: segments[{k}]"
        if not isinstance(segment, dict):
            raise DataError(f"{at}: must be an object, got {_kind(segment)}")
        ids, mask = check_tokens(segment.get("token_ids"), segment.get("loss_mask"), f"{at}.")
        turns = [Turn(a, b, "", "", 0.0) for a, b in check_spans(segment.get("spans"), len(ids),
                                                                  f"{at}.spans")]
        episodes.append(Episode(env="served", seed=0, group=0, token_ids=ids, loss_mask=mask,
                                logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                                turns=turns, reward=reward or 0.0, status="done",
                                info={"episode_id": row["episode_id"], "segment": k}))
    return Demonstration([], None, where, episodes, reward)


def episode_row(row: dict, where: str) -> Demonstration:
    """A turn-loop ``Episode`` as ``write_episodes`` wrote it (a run's ``episodes/``)."""
    ids, mask = check_tokens(row["token_ids"], row["loss_mask"], f"{where}: ")
    reward = _reward(row, where)
    episode = Episode(env=str(row.get("env", "episode")), seed=0, group=0, token_ids=ids,
                      loss_mask=mask, logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                      reward=reward or 0.0, status="done")
    return Demonstration([], None, where, [episode], reward)


def check_tokens(ids, mask, field: str) -> tuple[list[int], list[int]]:
    """Token ids (non-negative integers) and a loss mask of 0/1 of the same length;
    ``field`` starts the name of the fields in errors (``FILE:LINE: segments[0].``)."""
    if not isinstance(ids, list) or not ids or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise DataError(f"{field}token_ids: must be a non-empty list of token ids "
                        "(integers >= 0)")
    if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
        raise DataError(f"{field}loss_mask: must be a list of 0/1, one per token id "
                        f"({len(ids)})")
    return ids, [int(m) for m in mask]


def check_spans(spans, length: int, at: str) -> list[tuple[int, int]]:
    """A recording's turn spans: ``[[start, end], ...]`` within its ``length`` tokens."""
    if spans is None:
        return []
    pairs = spans if isinstance(spans, list) else None
    if pairs is None or not all(
            isinstance(p, list) and len(p) == 2 and all(
                isinstance(i, int) and not isinstance(i, bool) for i in p)
            and 0 <= p[0] <= p[1] <= length for p in pairs):
        raise DataError(f"{at}: must be a list of [start, end] token positions within the "
                        f"segment's {length} tokens")
    return [(a, b) for a, b in pairs]


def _reward(row: dict, where: str) -> float | None:
    reward = row.get("reward")
    if reward is None:
        return None
    value = float(reward) if isinstance(reward, float) else math.nan
    if isinstance(reward, int) and not isinstance(reward, bool) and abs(reward) < 1e300:
        value = float(reward)
    if not math.isfinite(value):
        raise DataError(f"{where}: reward: must be a finite number or null, got "
                        f"{_kind(reward) if not isinstance(reward, float) else reward}")
    return value


def check_tools(tools, where: str) -> None:
    """OpenAI tool schemas, ``{"type": "function", "function": {"name", "description",
    "parameters"}}``, names distinct; ``parameters`` a JSON schema object whose
    ``properties`` is an object and ``required`` a list of names (a template without tools
    lists them in the system prompt)."""
    if not isinstance(tools, list):
        raise DataError(f"{where}: tools: must be a list of tool schemas, got {_kind(tools)}")
    names = set()
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(f"{where}: tools[{k}].function.name: missing; a tool is "
                            '{"type": "function", "function": {"name", "parameters"}}')
        if function["name"] in names:
            raise DataError(f"{where}: tools[{k}].function.name: {function['name']!r} is "
                            "listed twice; name each tool once")
        names.add(function["name"])
        if not isinstance(function.get("description", ""), str | None):
            raise DataError(f"{where}: tools[{k}].function.description: must be text")
        check_parameters(function.get("parameters"), f"{where}: tools[{k}].function")


def check_parameters(parameters, at: str) -> None:
    """A tool's ``parameters``: absent, or an object schema the fallback prompt can show."""
    if parameters is None:
        return
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    required = parameters.get("required") if isinstance(parameters, dict) else None
    if (not isinstance(parameters, dict) or not isinstance(properties, dict | None)
            or not all(isinstance(p, dict) for p in (properties or {}).values())):
        raise DataError(f"{at}.parameters: must be a JSON schema object, "
                        '{"type": "object", "properties": {NAME: {"type": ...}}}')
    if not isinstance(required, list | None) or not all(isinstance(r, str)
                                                        for r in required or ()):
        raise DataError(f"{at}.parameters.required: must be a list of argument names")


def _drop_nulls(value):
    """A dataset's row without the nulls Arrow fills in for fields a row lacks (a user
    message gets ``tool_calls: None`` when another row has calls); content is kept."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None or k == "content"}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null",
            bool: "a boolean"}.get(type(value), "a number")
