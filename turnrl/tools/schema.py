"""A tool is a typed Python function; ``@tool`` derives its JSON schema (OpenAI function format).

The schema comes from the signature (str, int, float, bool, list[...], dict, Literal,
Optional / ``X | None``, defaults) and the docstring: its first paragraph describes the tool,
its Google-style ``Args:`` or numpy-style ``Parameters`` section the arguments.
``Tool.check_arguments`` validates what a model sent against that schema and says exactly
what is wrong, so a malformed call becomes an observation the model can learn from.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean",
               list: "array", dict: "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict
    """JSON schema of the arguments: {"type": "object", "properties": ..., "required": ...}"""
    fn: Callable[..., Any]

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def schema(self) -> dict:
        """The OpenAI function-calling entry, as chat templates take it in ``tools=``."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}

    def check_arguments(self, arguments: Any) -> str:
        """"" when ``arguments`` fit the schema, else one line saying what is wrong."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {_json_kind(arguments)}"
        props, required = self.parameters["properties"], self.parameters.get("required", [])
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            return (f"unknown argument{'s' * (len(unknown) > 1)} {', '.join(unknown)}; "
                    f"{self.name} takes {', '.join(props) or 'no arguments'}")
        missing = [name for name in required if name not in arguments]
        if missing:
            return f"missing argument {', '.join(missing)} ({self.signature_hint()})"
        for name, value in arguments.items():
            if problem := _type_problem(value, props[name]):
                return f"argument '{name}' {problem}"
        return ""

    def signature_hint(self) -> str:
        """e.g. ``multiply(a: integer, b: integer)``."""
        props = self.parameters["properties"]
        return f"{self.name}({', '.join(f'{k}: {_type_name(v)}' for k, v in props.items())})"


def tool(fn: Callable | None = None, *, name: str | None = None) -> Any:
    """Decorator: ``@tool`` or ``@tool(name="calc")`` on a sync or async function."""
    def wrap(f: Callable) -> Tool:
        return make_tool(f, name=name)
    return wrap(fn) if fn is not None else wrap


def make_tool(fn: Callable, name: str | None = None) -> Tool:
    """A ``Tool`` from a typed function; every parameter needs a type hint."""
    description, arg_docs = parse_docstring(inspect.getdoc(fn) or "")
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args/**kwargs cannot be described to a "
                            f"model; name each parameter")
        if param.name not in hints:
            raise TypeError(f"tool {fn.__name__}: parameter '{param.name}' needs a type hint "
                            f"(e.g. {param.name}: int)")
        prop = type_schema(hints[param.name], where=f"{fn.__name__}.{param.name}")
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
        elif param.default is not None:
            prop["default"] = param.default
        properties[param.name] = prop
    parameters = {"type": "object", "properties": properties, "required": required}
    return Tool(name or fn.__name__, description, parameters, fn)


def type_schema(hint: Any, where: str = "") -> dict:
    """JSON schema of one type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        if len(kept) == 1:  # Optional[X]: X, and null allowed
            schema = type_schema(kept[0], where)
            return {**schema, "nullable": True}
        return {"anyOf": [type_schema(a, where) for a in kept]}
    if origin is Literal:
        kinds = {type(a) for a in args}
        schema = {"enum": list(args)}
        return {"type": _JSON_TYPES[kinds.pop()], **schema} if len(kinds) == 1 else schema
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple):
        return {"type": "array", **({"items": type_schema(args[0], where)} if args else {})}
    if origin is dict or hint is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    raise TypeError(f"tool parameter {where}: type {hint!r} has no JSON schema; use str, int, "
                    f"float, bool, list[...], dict, Literal[...] or Optional[...]")


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns?|Raises|Yields|Examples?|Notes?|"
                      r"See Also):?$")
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\(.*?\))?\s*:\s*(.*)$")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph, {argument: description}) of a Google- or numpy-style docstring.

    Google: ``Args:`` then ``name (type): text`` lines. numpy: ``Parameters`` underlined with
    dashes, then ``name : type`` lines with the text indented below.
    """
    lines = doc.expandtabs().splitlines()
    paragraph: list[str] = []
    args: dict[str, str] = {}
    section, numpy, arg_indent, current = None, False, None, None
    for i, line in enumerate(lines):
        stripped = line.strip()
        underlined = i + 1 < len(lines) and set(lines[i + 1].strip()) == {"-"}
        header = _SECTION.match(stripped)
        if header and (stripped.endswith(":") or underlined):
            section, numpy, arg_indent, current = header.group(1), underlined, None, None
            continue
        if section is None:
            paragraph.append(stripped)
            continue
        if section not in ("Args", "Arguments", "Parameters") or not stripped or set(
                stripped) == {"-"}:
            continue
        indent = len(line) - len(line.lstrip())
        match = _ARG_LINE.match(stripped)
        if match and (arg_indent is None or indent <= arg_indent):
            arg_indent, current = indent, match.group(1)
            args[current] = "" if numpy else match.group(2)  # numpy: the rest is the type
        elif current is not None:
            args[current] = f"{args[current]} {stripped}".strip()
    blank = paragraph.index("") if "" in paragraph else len(paragraph)
    return " ".join(paragraph[:blank]).strip(), args


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    for py, name in ((int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                     (dict, "object")):
        if isinstance(value, py):
            return name
    return type(value).__name__


def _type_name(schema: dict) -> str:
    if "enum" in schema:
        return " | ".join(repr(v) for v in schema["enum"])
    if "anyOf" in schema:
        return " | ".join(_type_name(s) for s in schema["anyOf"])
    if schema.get("type") == "array" and "items" in schema:
        return f"array of {_type_name(schema['items'])}"
    return schema.get("type", "any")


def _type_problem(value: Any, schema: dict) -> str:
    """"" when ``value`` fits ``schema``, else e.g. "must be an integer, got string '12'"."""
    if value is None:
        return "" if schema.get("nullable") else f"must be {_type_name(schema)}, got null"
    if "anyOf" in schema:
        fits = any(not _type_problem(value, s) for s in schema["anyOf"])
        return "" if fits else f"must be {_type_name(schema)}, got {_json_kind(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {_type_name(schema)}, got {value!r}"
    kind, expected = _json_kind(value), schema.get("type")
    if expected is None or kind == expected or (expected == "number" and kind == "integer"):
        if kind == "array" and "items" in schema:
            for i, item in enumerate(value):
                if problem := _type_problem(item, schema["items"]):
                    return f"item {i} {problem}"
        return ""
    article = "an" if expected[0] in "aeiou" else "a"
    shown = repr(value) if len(repr(value)) < 40 else repr(value)[:37] + "..."
    return f"must be {article} {expected}, got {kind} {shown}"
