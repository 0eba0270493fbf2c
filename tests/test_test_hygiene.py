"""Test modules never import from other test modules: shared helpers live in helpers modules.

A `tests/test_*.py` file is collected by pytest; importing one from another runs its module
body twice under two names, couples two suites, and hides where a helper lives. Helpers shared
by several test files go to a module without the `test_` prefix (tests/tito_support.py,
tests/cli_harness_support.py, tests/sandbox_contract.py, ...), fixtures to tests/conftest.py.
Every Python file under tests/ is parsed (not imported) and each import is checked, lazy imports
inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# Exceptions, file -> test modules it may import. Empty: the cases found when this test was written
# moved to helpers modules (harbor_support, trainer_support, megatron_support, train_support; the
# shared `tiny_model` fixture to conftest.py). The torchrun scripts (test_megatron_pp/_tp) put the
# repository root on sys.path to import `tests.megatron_support`. Keep it empty.
KNOWN: dict[str, set[str]] = {}


def _is_test_module(dotted: str) -> bool:
    """`tests.test_x`, `test_x` (rootdir on sys.path) or anything below them."""
    parts = dotted.split(".")
    if parts[0] == "tests":
        parts = parts[1:]
    return bool(parts) and parts[0].startswith("test_")


def imports_of_test_modules(source: str) -> list[str]:
    """The modules `source` imports that are test modules, as written (`tests.test_x`, `.test_x`)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if base and _is_test_module(base):
                found.append("." * node.level + base)
            elif base in ("", "tests"):  # `from tests import test_x`, `from . import test_x`
                prefix = "." * node.level + (f"{base}." if base else "")
                found += [prefix + a.name for a in node.names if a.name.startswith("test_")]
    return found


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "cache" not in p.parent.name)


def test_no_test_module_imports_another() -> None:
    files = _python_files()
    assert TESTS / "tito_support.py" in files and TESTS / "conftest.py" in files
    found = {
        str(p.relative_to(TESTS.parent)): set(imports)
        for p in files
        if (imports := imports_of_test_modules(p.read_text(encoding="utf-8")))
    }
    new = {f: m - KNOWN.get(f, set()) for f, m in found.items() if m - KNOWN.get(f, set())}
    assert not new, f"import helpers from a helpers module, not a test module: {new}"
    gone = {f: m - found.get(f, set()) for f, m in KNOWN.items() if m - found.get(f, set())}
    assert not gone, f"fixed, well done: delete these from KNOWN in {Path(__file__).name}: {gone}"


def test_the_checker_catches_every_spelling() -> None:
    # `{pkg}`: so a plain grep for imports of test modules does not match this file
    planted = """
import {pkg}.test_a
from {pkg}.test_b import helper
from {pkg} import test_c, tito_support
from .test_d import x
from . import test_e
from test_f import y

def lazy():
    from {pkg}.test_g.sub import z
""".format(pkg="tests")
    assert imports_of_test_modules(planted) == [
        "tests.test_a",
        "tests.test_b",
        "tests.test_c",
        ".test_d",
        ".test_e",
        "test_f",
        "tests.test_g.sub",
    ]
    fine = "import tests.tito_support\nfrom tests.cli_harness_support import run_one\nfrom tests import conftest\n"
    assert imports_of_test_modules(fine) == []
