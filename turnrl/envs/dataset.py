"""``dataset``: one task per row of a local dataset, with real train/eval splits.

``--env.name dataset --env.options.path P`` reads JSONL, CSV, parquet or a directory saved by
Hugging Face ``datasets`` (``save_to_disk``; offline). Each row gives a prompt (``prompt``: a
column of text, or ``messages``: a column of chat messages, whose user turns become the prompt
and whose system turn the system message) and an answer (``answer``), and the reply earns the
named reward: ``exact_match``, ``numeric_match``, ``integer_match``, ``math_answer``, or
``code_tests`` (the row's ``tests`` column, run in the sandbox). ``none`` (or ``judge``,
``model``, which also say which one the config must set) pays 0 and checks nothing: an LLM
judge or a reward model, applied by the trainer to every env's episodes, gives the reward, so
such rows need no answer; their info has no ``success`` (none was checked). ``metadata``
names columns passed through to the episode's ``info["metadata"]`` and told to a judge
(``info["judge_reference"]``, never shown to the policy). One turn; wrap it in ``try-again``
for several attempts.

Splits are real. The eval rows are, in this order of precedence: ``eval_path``'s rows; a saved
``DatasetDict``'s ``test`` (else ``validation``) split; the rows whose ``split`` column says
test/eval/validation; else a held-out ``eval_fraction`` of the rows chosen by a stable hash of
each row's content (the same rows on every machine and run, whatever the file's order).
Training draws only training rows (``split: train``, the default), evaluation only eval rows
(evaluation builds the env with ``split: eval``: ``eval_options``), so no held-out seed can land
on a training row. Training seeds walk a shuffled order of the training rows, one epoch after
another (``epoch = seed // rows``, each epoch its own permutation from ``shuffle_seed``), so a
resumed run draws exactly the rows the uninterrupted one would.

Bad input fails at start-up in one line naming the file, the row as the user sees it
(``FILE:LINE`` in JSONL and CSV, ``FILE: row N`` from 1 in parquet and datasets files) and the
field: a missing column, an empty split, an answer the reward cannot read (numeric rewards,
every ``math_answer`` reference parsed), ``tests`` that are not a list of strings (a CSV cell
holding a JSON list is read as one).
"""

from __future__ import annotations

import csv
import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnrl.datafile import DataFileError, parse_json, text_lines
from turnrl.envs.base import StepResult, register_env
from turnrl.rewards import code_tests_async, exact_match, integer_match, math_answer, numeric_match
from turnrl.rewards.math_answer import parse_reference

EVAL_SPLITS = ("test", "eval", "validation")
REWARDS: dict[str, Callable[..., Any]] = {
    "exact_match": exact_match, "numeric_match": numeric_match, "math_answer": math_answer,
    "integer_match": lambda reply, answer: integer_match(reply, int(answer)),
}
NUMERIC = {"numeric_match": float, "integer_match": int}
TRAINER_REWARDS = ("none", "judge", "model")
"""Rewards the env leaves to the trainer's judge or reward model (config/checks.py requires
one: ``judge`` the judge section, ``model`` reward.model, ``none`` either)."""
CHOICES = (*REWARDS, "code_tests", *TRAINER_REWARDS)


class DatasetError(ValueError):
    """A dataset the env cannot use: one line naming the file, row and field."""


class Row(dict):
    """A row that knows where the user wrote it (``FILE:LINE``, ``FILE: row N``) for error
    messages; otherwise the plain dict (its split hash, equality and JSON are the dict's)."""

    def __init__(self, data: dict, where: str) -> None:
        super().__init__(data)
        self.where = where


def numbered(rows: list[dict], where: str) -> list[Row]:
    """Rows of a table file, each named ``WHERE: row N`` (from 1, as turnrl sft names them)."""
    return [Row(row, f"{where}: row {n}") for n, row in enumerate(rows, 1)]


def read_rows(path: str) -> dict[str, list[dict]]:
    """The rows of ``path`` by split name ("" when the file has no splits of its own)."""
    file = Path(path).expanduser()
    if not file.exists():
        raise DatasetError(f"dataset '{path}' does not exist; pass --env.options.path FILE "
                           "(.jsonl, .csv, .parquet or a datasets directory)")
    if file.is_dir():
        return _saved_dataset(file)
    suffix = file.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return {"": _jsonl(file)}
    if suffix == ".csv":
        with file.open(newline="", encoding="utf-8-sig") as handle:  # -sig: Excel's BOM
            return {"": _csv_rows(csv.DictReader(handle), file)}
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return {"": numbered(pq.read_table(file).to_pylist(), str(file))}
    raise DatasetError(f"dataset '{path}': unknown format '{suffix}'; use .jsonl, .csv, "
                       ".parquet or a directory saved by datasets' save_to_disk")


def _csv_rows(reader: csv.DictReader, file: Path) -> list[Row]:
    """Each record named by the line it starts on (``line_num`` is the line a record ends on,
    later when a quoted cell spans lines)."""
    if reader.fieldnames is None:  # reading them reads the header; the first record follows
        return []
    rows, start = [], reader.line_num + 1
    for row in reader:
        rows.append(Row(row, f"{file}:{start}"))
        start = reader.line_num + 1
    return rows


def _jsonl(file: Path) -> list[Row]:
    rows = []
    try:
        for number, line in text_lines(file):
            if line.strip():
                row = parse_json(line, f"{file}:{number}")
                if not isinstance(row, dict):
                    raise DatasetError(f"{file}:{number}: a {type(row).__name__}, not an "
                                       "object; one JSON object per line")
                rows.append(Row(row, f"{file}:{number}"))
    except DataFileError as err:
        raise DatasetError(str(err)) from None
    return rows


def _saved_dataset(directory: Path) -> dict[str, list[dict]]:
    import datasets  # the envs extra

    try:
        saved = datasets.load_from_disk(str(directory))
    except FileNotFoundError as err:
        raise DatasetError(f"dataset directory '{directory}' was not written by datasets' "
                           f"save_to_disk ({err}); pass a file or such a directory") from None
    if isinstance(saved, datasets.DatasetDict):
        return {name: numbered(saved[name].to_list(), f"{directory} [{name}]")
                for name in saved}
    return {"": numbered(saved.to_list(), str(directory))}


def held_out(row: dict, fraction: float) -> bool:
    """Whether ``row`` is in the eval split by a stable hash of its content."""
    digest = hashlib.blake2b(json.dumps(row, sort_keys=True, default=str).encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def check_split(env: str, split: object, eval_fraction: object) -> None:
    """One line naming a split that is neither train nor eval, or a held-out fraction that is
    not a number in (0, 1) (a string would otherwise fail later with Python's own '<')."""
    if split not in ("train", "eval"):
        raise DatasetError(f"{env}: split {split!r}: use train or eval")
    if (isinstance(eval_fraction, bool) or not isinstance(eval_fraction, int | float)
            or not 0 < eval_fraction < 1):
        raise DatasetError(f"{env}: eval_fraction must be in (0, 1), got {eval_fraction!r}")


def split_rows(by_split: dict[str, list[dict]], eval_rows: list[dict] | None,
               split_column: str, fraction: float) -> tuple[list[dict], list[dict]]:
    """(training rows, eval rows) by the precedence in the module docstring."""
    if eval_rows is not None:
        return [r for rows in by_split.values() for r in rows], eval_rows
    if set(by_split) - {""}:
        named = next((by_split[s] for s in EVAL_SPLITS if s in by_split), None)
        train = by_split.get("train") or [r for s, rows in by_split.items()
                                          if s not in EVAL_SPLITS for r in rows]
        if named is not None:
            return train, named
        by_split = {"": train}
    rows = by_split[""]
    if any(split_column in row for row in rows):
        return ([r for r in rows if str(r.get(split_column, "train")).lower() not in EVAL_SPLITS],
                [r for r in rows if str(r.get(split_column, "")).lower() in EVAL_SPLITS])
    return ([r for r in rows if not held_out(r, fraction)],
            [r for r in rows if held_out(r, fraction)])


def row_order(seed: int, rows: int, shuffle_seed: int) -> int:
    """The row a training seed draws: epoch ``seed // rows`` walks its own permutation."""
    epoch, position = divmod(seed, rows)
    order = list(range(rows))
    random.Random(f"{shuffle_seed}:{epoch}").shuffle(order)
    return order[position]


def prompt_of(row: dict, prompt: str, messages: str) -> tuple[str | None, str | None]:
    """(the prompt, the system message) of ``row``; (None, None) when it has neither column."""
    if isinstance(row.get(prompt), str) and row[prompt].strip():
        return row[prompt], None
    chat = row.get(messages)
    if isinstance(chat, list) and chat and all(isinstance(m, dict) for m in chat):
        users = [str(m.get("content", "")) for m in chat if m.get("role") == "user"]
        system = next((str(m["content"]) for m in chat if m.get("role") == "system"), None)
        if users:
            return "\n\n".join(users), system
    return None, None


_LOADED: dict[tuple, tuple[list[dict], list[dict]]] = {}
_CHECKED: set[tuple] = set()  # (the loaded rows' id, columns, reward) that passed check_rows


def load_splits(path: str, eval_path: str, split_column: str, fraction: float
                ) -> tuple[list[dict], list[dict]]:
    """(training rows, eval rows), read once per file version in this process (an env is
    built per episode)."""
    def version(p: str) -> tuple:
        file = Path(p).expanduser()
        return (str(file.resolve()), file.stat().st_mtime_ns) if file.exists() else (p,)

    key = (version(path), version(eval_path) if eval_path else None, split_column, fraction)
    if key not in _LOADED:
        extra = None
        if eval_path:
            extra = [r for rows in read_rows(eval_path).values() for r in rows]
        _LOADED[key] = split_rows(read_rows(path), extra, split_column, fraction)
    return _LOADED[key]


@register_env("dataset")
class DatasetEnv:
    """A task per row of a local dataset (JSONL/CSV/parquet/datasets dir), real train/eval
    splits, a reward by name (docs/datasets.md)."""

    cooperative = True  # reset/step never block (code_tests awaits its sandbox)

    def __init__(self, path: str = "", split: str = "train", prompt: str = "prompt",
                 messages: str = "messages", answer: str = "answer", tests: str = "tests",
                 reward: str = "exact_match", instruction: str = "", eval_path: str = "",
                 eval_fraction: float = 0.1, split_column: str = "split",
                 shuffle_seed: int = 0, metadata: str | list[str] = ""):
        if reward not in CHOICES:
            raise DatasetError(f"dataset reward '{reward}' is unknown; choose one of: "
                               f"{', '.join(CHOICES)}")
        check_split("dataset", split, eval_fraction)
        train, held = load_splits(path, eval_path, split_column, eval_fraction)
        self.rows = train if split == "train" else held
        self.split, self.reward_name, self.instruction = split, reward, instruction
        self.columns = {"prompt": prompt, "messages": messages, "answer": answer, "tests": tests,
                        "metadata": metadata_columns(metadata)}
        self.shuffle_seed, self.row, self.metadata = shuffle_seed, {}, {}
        self.eval_options = {"split": "eval"}  # what evaluation builds (policy.env_factories)
        checked = (id(self.rows), tuple(self.columns.values()), reward)
        if checked not in _CHECKED:  # an env is built per episode: check the rows once
            check_rows(self.rows, f"{path} ({split} split)", self.columns, reward)
            _CHECKED.add(checked)
        self.system_prompt: str | None = None

    async def reset(self, seed: int) -> str:
        index = (row_order(seed, len(self.rows), self.shuffle_seed) if self.split == "train"
                 else seed % len(self.rows))
        self.row = self.rows[index]
        self.metadata = metadata_of(self.row, self.columns["metadata"])
        prompt, self.system_prompt = prompt_of(self.row, self.columns["prompt"],
                                               self.columns["messages"])
        return f"{prompt}\n\n{self.instruction}" if self.instruction else prompt

    async def step(self, action: str) -> StepResult:
        extra = ({"metadata": self.metadata, "judge_reference": reference_text(self.metadata)}
                 if self.metadata else {})
        if self.reward_name in TRAINER_REWARDS:  # the judge or reward model scores it
            return StepResult("", 0.0, True, extra)
        if self.reward_name == "code_tests":
            tests = tests_of(self.row[self.columns["tests"]], where_of(self.row, "the row"))
            score = await code_tests_async(action, tests)
        else:
            score = REWARDS[self.reward_name](action, self.row[self.columns["answer"]])
        reward = float(score or 0.0)  # None: the reply states no answer the reward can read
        return StepResult("", reward, True, {"success": reward >= 1.0,
                                             "answered": score is not None, **extra})

    def reference_player(self) -> AnswerPlayer:
        """States the row's answer (guidance and scripted demonstrations; code: none)."""
        return AnswerPlayer(self)


class AnswerPlayer:
    """The dataset's oracle: replies with the current row's answer in a box."""

    def __init__(self, env: DatasetEnv) -> None:
        self.env = env

    def reset(self, first_observation: str) -> None:
        pass

    def act(self, observation: str) -> str:
        answer = self.env.row.get(self.env.columns["answer"], "")
        return f"The answer is \\boxed{{{answer}}}."


def metadata_columns(option: object) -> tuple[str, ...]:
    """The ``metadata`` option's column names: one name, names joined by commas, or a list."""
    names = option.split(",") if isinstance(option, str) else option
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise DatasetError(f"dataset metadata {option!r}: name columns, e.g. "
                           "--env.options.metadata source,level")
    return tuple(n.strip() for n in names if n.strip())


def metadata_of(row: dict, names: tuple[str, ...]) -> dict:
    """The row's metadata: one named column holding a dict gives that dict; otherwise each
    named column's value by its name."""
    if len(names) == 1 and isinstance(row.get(names[0]), dict):
        return dict(row[names[0]])
    return {name: row.get(name) for name in names}


def reference_text(metadata: dict) -> str:
    """The metadata as the judge reads it (``rewards/judge.py::with_reference``)."""
    return "; ".join(f"{key}: {value}" for key, value in metadata.items())


def where_of(row: dict, fallback: str) -> str:
    """Where the user wrote ``row`` (``Row.where``), else ``fallback``."""
    return getattr(row, "where", "") or fallback


def tests_of(value: object, where: str) -> list[str]:
    """A row's ``tests`` as a list of strings; text holding a JSON list (a CSV cell) is read as
    one, since ``list()`` of a string would make one test per character."""
    tests = value
    if isinstance(value, str):
        try:
            tests = json.loads(value)
        except json.JSONDecodeError:
            tests = None
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        shown = str(value)[:80]
        raise DatasetError(f"{where}: tests {shown!r} is not a list of test strings; write a "
                           'JSON list such as ["assert f(1) == 2"]')
    return tests


def check_rows(rows: list[dict], where: str, columns: dict[str, Any], reward: str) -> None:
    """Every row has a prompt, its metadata columns and what its reward reads, in one line
    naming the first that does not (its file line or row); an empty split is refused."""
    if not rows:
        raise DatasetError(f"{where} has no rows; give the dataset an eval split (a 'split' "
                           "column, eval_path, a DatasetDict 'test' split) or raise eval_fraction"
                           if "eval" in where else f"{where} has no rows")
    for number, row in enumerate(rows):
        check_row(row, where_of(row, f"{where} row {number}"), columns, reward)


def check_row(row: dict, at: str, columns: dict[str, Any], reward: str) -> None:
    """One row's checks (``check_rows``); ``at`` names it."""
    if prompt_of(row, columns["prompt"], columns["messages"])[0] is None:
        raise DatasetError(f"{at}: no '{columns['prompt']}' text or '{columns['messages']}' "
                           "chat; name the column with --env.options.prompt (or messages)")
    missing = next((name for name in columns["metadata"] if name not in row), None)
    if missing is not None:
        raise DatasetError(f"{at}: no '{missing}' column, which --env.options.metadata names; "
                           "add it to every row or drop it from metadata")
    if reward in TRAINER_REWARDS:
        return  # nothing to check: the judge or reward model scores the reply
    option = "tests" if reward == "code_tests" else "answer"
    needed = columns[option]
    value = row.get(needed)
    if value in (None, ""):
        raise DatasetError(f"{at}: no '{needed}' value for reward {reward}; name the column "
                           f"with --env.options.{option}")
    if reward == "code_tests":
        tests_of(value, at)
    elif reward == "math_answer":
        try:
            parse_reference(value)
        except ValueError:
            raise DatasetError(f"{at}: answer {value!r} does not parse as math, which "
                               "math_answer needs; write a number or LaTeX, or use "
                               "exact_match") from None
    elif reward in NUMERIC:
        try:
            NUMERIC[reward](value)
        except (TypeError, ValueError):
            raise DatasetError(f"{at}: answer {value!r} is not a number, which {reward} "
                               "needs") from None
