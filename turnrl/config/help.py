"""``turnrl train --help [SECTION|all]``: the sections one line each, or a section's options
with their types, defaults and docs (read from the code, so the help never drifts)."""

from __future__ import annotations

import dataclasses
import textwrap

from turnrl.config.root import Config, sections
from turnrl.config.types import ConfigError, did_you_mean, field_docs, type_hints, type_name
from turnrl.registry import ESTIMATORS

WIDTH = 100


def sections_help() -> str:
    """One line per section: its name, what it is for, how many options it has."""
    docs = field_docs(Config)
    width = max(map(len, sections()))
    lines = [f"  {name:<{width}}  {docs[name]} ({len(dataclasses.fields(cls))} options)"
             for name, cls in sections().items()]
    return "\n".join(lines)


def _shown(value: object) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _doc(section: str, key: str, doc: str) -> str:
    """The field's docstring; a critic option also names the estimators that read it."""
    if section != "critic":
        return doc
    readers = [name for name, entry in ESTIMATORS.items() if key in entry.options]
    return f"{doc} (read by: {', '.join(readers) or 'no registered estimator'})"


def section_help(name: str) -> str:
    """Every option of section ``name``: ``--name.key TYPE (default D)`` and its docstring."""
    if name not in sections():
        hint = did_you_mean(name, list(sections())) or f"; choose one of: {', '.join(sections())}"
        raise ConfigError(f"--help {name}: no such config section{hint} (or 'all')")
    cls, docs = sections()[name], field_docs(sections()[name])
    defaults = dataclasses.asdict(cls())
    lines = [f"{name}: {field_docs(Config)[name]}"]
    for key, tp in type_hints(cls).items():
        lines.append(f"  --{name}.{key} {type_name(tp)} (default {_shown(defaults[key])})")
        lines += textwrap.wrap(_doc(name, key, docs[key]), WIDTH, initial_indent=" " * 6,
                               subsequent_indent=" " * 6)
    return "\n".join(lines)


def config_help(section: str | None = None) -> str:
    """No section: the sections, one line each; a section's name: its options; 'all': every
    section's options."""
    if section is None:
        return ("Config sections (--help SECTION lists a section's options, --help all every "
                "option):\n" + sections_help())
    if section == "all":
        return "\n\n".join(section_help(name) for name in sections())
    return section_help(section)
