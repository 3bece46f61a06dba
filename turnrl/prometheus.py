"""The Prometheus text exposition format (version 0.0.4), written by hand: ``turnrl serve``'s
``/metrics`` and a training run's (``--run.tracking prometheus``) need nothing more than
these few lines, and no client library.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Sample = tuple[dict[str, str], float]
Family = tuple[str, str, str, list[Sample]]
"""(name, type, help, samples): one metric family of the exposition."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if value != int(value) else str(int(value))


def exposition(families: Iterable[Family]) -> str:
    """Families in the Prometheus text format: ``# HELP``, ``# TYPE``, then one line per
    sample, ``name{label="value",...} number``; a summary's samples carry their own
    ``_sum`` / ``_count`` suffix in their ``__name__`` label."""
    lines = []
    for name, kind, text, samples in families:
        help_text = text.replace("\\", "\\\\").replace("\n", "\\n")
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            labels = dict(labels)
            full = name + labels.pop("__name__", "")
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            lines.append(f"{full}{{{body}}} {_number(value)}" if body
                         else f"{full} {_number(value)}")
    return "\n".join(lines) + "\n"


def metric_name(key: str, prefix: str = "turnrl_") -> str:
    """A metrics.jsonl key as a Prometheus name: ``reward/mean`` -> ``turnrl_reward_mean``,
    ``eval/pass@4`` -> ``turnrl_eval_pass_4`` (names take ``[a-zA-Z0-9_:]`` only)."""
    return prefix + re.sub(r"[^a-zA-Z0-9_:]", "_", key)
