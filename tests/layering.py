"""Who imports whom, read from the source: the checker behind tests/test_layering.py.

Every module of the package (as pyproject's package-dir maps it: `tito/proxy.py` is
`miles_env.tito.proxy`) and of the built-in environments is parsed, not imported. Each
import of a project module is recorded with where it runs: at module level (on import),
lazily inside a function, or only for the type checker (`if TYPE_CHECKING:`). A `Rule` is
one sentence of INVARIANTS.md as data: which importers, which targets they may not reach,
and which kinds of import count. `violations()` and `cycles()` take any tree, so the test
can also show the checker catching a planted violation.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "EVERY",
    "ON_IMPORT",
    "RUNTIME",
    "Import",
    "Rule",
    "modules_of",
    "imports_of",
    "violations",
    "cycles",
]

Where = Literal["module", "lazy", "typing"]
RUNTIME: frozenset[Where] = frozenset({"module", "lazy"})
ON_IMPORT: frozenset[Where] = frozenset({"module"})
EVERY: frozenset[Where] = frozenset({"module", "lazy", "typing"})


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a module name (project module, or the top-level name of a third-party one)
    line: int
    where: Where


@dataclass(frozen=True)
class Rule:
    text: str  # the rule as INVARIANTS.md words it
    importer: Callable[[str], bool]
    forbidden: Callable[[str], bool]
    kinds: frozenset[Where] = RUNTIME
    allow: Callable[[str, str], bool] = lambda importer, target: False  # exceptions, by pair


def modules_of(root: Path) -> dict[str, Path]:
    """module name -> file, for the package (pyproject's package-dir) and envs/*/ packages."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    out: dict[str, Path] = {}
    for package, folder in tool["package-dir"].items():
        _walk(root / folder, package, out)
    for env_pyproject in sorted(root.glob("envs/*/pyproject.toml")):
        for init in sorted(env_pyproject.parent.glob("*/__init__.py")):
            _walk(init.parent, init.parent.name, out)
    return out


def _walk(folder: Path, package: str, out: dict[str, Path]) -> None:
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join([package, *parts])
        out.setdefault(name, path)  # a mapped subpackage's own folder wins over a same-named file


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []
    _visit(tree.body, "module", name, package, known, found)
    return found


def _visit(
    body: list[ast.stmt], where: Where, name: str, package: str, known: set[str], out: list[Import]
) -> None:
    for node in body:
        if isinstance(node, ast.Import):
            out += [Import(name, _project_or_top(a.name, known), node.lineno, where) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append(
                    Import(name, sub if sub in known else _project_or_top(base, known), node.lineno, where)
                )
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            _visit(node.body, "typing", name, package, known, out)
            _visit(node.orelse, where, name, package, known, out)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            _visit(node.body, "lazy", name, package, known, out)
        else:
            children = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
            _visit(children, where, name, package, known, out)


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _project_or_top(module: str, known: set[str]) -> str:
    """A project module keeps its full name (even one the tree lacks); a third-party one, its top."""
    top = module.split(".")[0]
    return module if any(k == top or k.startswith(top + ".") for k in known) else top


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def all_imports(modules: dict[str, Path]) -> list[Import]:
    known = set(modules)
    return [imp for name, path in modules.items() for imp in imports_of(name, path, known)]


def violations(imports: list[Import], rules: list[Rule]) -> list[str]:
    return [
        f"{imp.importer}:{imp.line} imports {imp.target} ({imp.where}): breaks '{rule.text}'"
        for rule in rules
        for imp in imports
        if imp.where in rule.kinds
        and rule.importer(imp.importer)
        and rule.forbidden(imp.target)
        and not rule.allow(imp.importer, imp.target)
    ]


def cycles(imports: list[Import], kinds: frozenset[Where] = EVERY) -> list[list[str]]:
    """Strongly connected components (size > 1, or a self-import) of the import graph.

    Every kind of import counts by default: a lazy import or a `TYPE_CHECKING` one that closes a
    circle does not fail at import time, but the two modules still need each other, which is
    the design flaw the check is for (two such modules are one, or share a third)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.where in kinds:
            graph.setdefault(imp.importer, set()).add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan; the graph is a few hundred nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found
