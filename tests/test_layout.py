"""The package's layering: every import in turnrl/ goes down (or sideways), never up, no cycles.

Layers, lowest first (docs/architecture.md explains each). A module may import modules of its
own layer or below. Deferred imports inside functions count: one used to dodge a cycle is
still a cycle. A new top-level module or package must be given a layer here.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "turnrl"
LAYERS = [
    {"registry", "types", "config", "stats", "safe_json", "leftovers", "devices", "datafile"},
    {"models", "gguf_weights", "hub", "lora", "envs", "rewards", "tools", "sandbox", "rollout", "metrics", "tracking", "prometheus",
     "checkpoint", "demos", "evaluation", "samplers", "learner"},
    {"algorithms", "policy", "selfplay"},
    {"trainer", "sft"},
    {"distributed"},
    {"launch", "cli", "report", "serve", "tinker", "checkpoint_eval", "export", "__main__"},
]
LAYER = {name: depth for depth, names in enumerate(LAYERS) for name in names}
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
MAX_METHODS = 20
STILL_OVER: set[str] = set()
"""Functions and classes over the limits that are yet to be split (issue 51): none may join."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every turnrl module ``path`` imports, at any depth of the file."""
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("turnrl")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                "turnrl") and node.level == 0:
            # `from turnrl.pkg import sub` imports the submodule when it is one, and the
            # package's own names otherwise
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _path_of(candidate) is not None else node.module)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node that can run: all of them but the bodies of ``if TYPE_CHECKING:`` (imports
    for annotations only, never executed)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _path_of(module: str) -> Path | None:
    base = PACKAGE.parent.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _top(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_every_import_goes_down_a_layer_or_stays():
    graph = _graph()
    unknown = sorted({_top(m) for m in graph if _top(m) and _top(m) not in LAYER})
    assert not unknown, f"give these top-level modules a layer in tests/test_layout.py: {unknown}"
    upward = [f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts
              if _top(src) and _top(dst) and LAYER[_top(dst)] > LAYER[_top(src)]]
    assert not upward, "imports going up a layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycles_between_top_level_modules_and_packages():
    """E.g. trainer -> distributed -> trainer, even through a deferred import."""
    units: dict[str, set[str]] = {}
    for src, dsts in _graph().items():
        if _top(src):
            units.setdefault(_top(src), set()).update(
                _top(d) for d in dsts if _top(d) and _top(d) != _top(src))
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(units.get(node, ())):
            if nxt in path:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            else:
                visit(nxt, path + [nxt])

    for unit in sorted(units):
        visit(unit, [unit])
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def _oversized() -> dict[str, str]:
    """Every library function over ``MAX_FUNCTION_LINES`` lines and class over
    ``MAX_CLASS_LINES`` lines or ``MAX_METHODS`` methods: ``{"file.py:Name": "what"}``."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if lines > MAX_FUNCTION_LINES:
                    found[f"{where}:{node.name}"] = f"{lines} lines"
            elif isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                              for n in node.body)
                if lines > MAX_CLASS_LINES or methods > MAX_METHODS:
                    found[f"{where}:{node.name}"] = f"{lines} lines, {methods} methods"
    return found


def test_functions_and_classes_stay_small():
    """A function over 60 lines or a class over 300 lines or 20 methods is a sign to split it
    by responsibility (DESIGN.md); files are as long as their one idea needs. ``STILL_OVER``
    names the ones not split yet: it may only shrink (an entry that fits fails too)."""
    found = _oversized()
    new = {name: what for name, what in found.items() if name not in STILL_OVER}
    assert not new, f"split these by responsibility: {new}"
    fitted = sorted(set(STILL_OVER) - set(found))
    assert not fitted, f"these fit now: remove them from STILL_OVER: {fitted}"


def test_the_size_rule_catches_a_long_function_and_a_wide_class(tmp_path, monkeypatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    methods = "\n".join(f"    def m{i}(self):\n        pass" for i in range(MAX_METHODS + 1))
    (tmp_path / "big.py").write_text(f"def long():\n{body}\n\n\nclass Wide:\n{methods}\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert _oversized() == {"big.py:long": f"{MAX_FUNCTION_LINES + 1} lines",
                            "big.py:Wide": f"{2 * MAX_METHODS + 3} lines, {MAX_METHODS + 1} methods"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_import_cycles_between_modules():
    """Module by module, deferred imports included: ``serve.train`` -> ``serve.async_train``
    -> ``serve.train`` was one, hidden inside a function. A package's ``__init__`` that
    re-exports its modules is not part of a cycle through them: modules inside a package
    import each other by module path, never through their own package."""
    graph = {src: {d for d in dsts if d != src} for src, dsts in _graph().items()}
    own_package = [f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts
                   if dst != "turnrl" and _path_of(dst) is not None
                   and _path_of(dst).name == "__init__.py" and src.startswith(dst + ".")]
    assert not own_package, ("import sibling modules by their own path, not through the "
                             "package:\n" + "\n".join(sorted(own_package)))
    cycles = _cycles(graph)
    assert not cycles, "module import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_deferred_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_serve_uses_no_distributed_internals():
    """A served run is a rollout source of the one learner loop: it shares the trainer's
    staleness buffer, not the Ray source's books (``serve/`` imported ``distributed/book.py``
    for ``split_stale`` before the loops were one)."""
    reached = sorted({f"{src} -> {dst}" for src, dsts in _graph().items() for dst in dsts
                      if _top(src) == "serve" and _top(dst) == "distributed"})
    assert not reached, "serve/ imports distributed/:\n" + "\n".join(reached)
