"""Preference pairs for ``turnrl rm`` and the Bradley-Terry loss it trains on.

A row of the JSONL file is ``{"prompt": P, "chosen": C, "rejected": R}``: ``P`` a text (the
user's message) or a list of chat messages, ``C``/``R`` a text (the assistant's reply) or a
list of messages; without ``prompt``, ``C`` and ``R`` are whole conversations. A local
Hugging Face dataset (``.parquet``, ``.arrow``, a ``save_to_disk`` directory) with those
columns is read too, by the reader ``turnrl sft`` uses (``read_rows``). Each side is
rendered by the reward model's chat template (``render_conversation``), as the policy's
transcripts are when the model scores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from turnrl.demos.data import DataError, check_message, read_rows

PAIR_FORMAT = ('one JSON object a line: {"prompt": ..., "chosen": ..., "rejected": ...} (text '
               'or lists of {"role", "content"} messages)')


@dataclass(frozen=True)
class Pair:
    chosen: list[dict]
    rejected: list[dict]
    where: str
    """``FILE:LINE`` (a dataset: ``FILE: row N``), for messages about this row."""


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Mean of -log sigmoid(r_chosen - r_rejected): the negative log-likelihood of the
    preferences under the Bradley-Terry model (Bradley & Terry 1952), as reward models are
    trained in Ouyang et al. 2022 (arXiv:2203.02155, eq. 1). chosen, rejected [N] -> scalar."""
    return -F.logsigmoid(chosen - rejected).mean()


def read_pairs(path: str | Path) -> list[Pair]:
    """Every row of ``path`` as a ``Pair``: a JSONL file or a local Hugging Face dataset
    (``.parquet``, ``.arrow``, a ``save_to_disk`` directory), read as ``turnrl sft`` reads
    demonstrations (``read_rows``); ``DataError`` naming the file, line or row and field."""
    return read_rows(path, parse_pair, option="reward.data", what="preference pairs",
                     row_format=PAIR_FORMAT)


def parse_pair(row, where: str) -> Pair:
    """One row as a ``Pair`` (see the module docstring)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object; {PAIR_FORMAT}")
    for key in ("chosen", "rejected"):
        if key not in row:
            raise DataError(f"{where}: {key}: missing; {PAIR_FORMAT}")
    prompt = _messages(row["prompt"], "user", f"{where}: prompt") if "prompt" in row else []
    chosen = prompt + _messages(row["chosen"], "assistant", f"{where}: chosen")
    rejected = prompt + _messages(row["rejected"], "assistant", f"{where}: rejected")
    if chosen == rejected:
        raise DataError(f"{where}: chosen and rejected are the same; a pair must differ")
    return Pair(chosen, rejected, where)


def _messages(value, role: str, at: str) -> list[dict]:
    """A text as one ``role`` message, or a checked list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(f"{at}: must be a text or a non-empty list of messages, got "
                        f"{type(value).__name__}")
    calls: dict[str, str] = {}
    return [check_message(m, f"{at}[{i}]", calls) for i, m in enumerate(value)]
