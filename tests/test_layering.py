"""INVARIANTS.md's layering section, enforced: one `Rule` per sentence, checked on the source.

Also: the import graph has no cycle (module-level, lazy and type-only imports alike), importing the core pulls in no
plug-in implementation (checked in a fresh interpreter, so transitive imports count), and
the checker itself catches a planted violation and a planted cycle (so this test can fail).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.layering import ON_IMPORT, Import, Rule, all_imports, cycles, modules_of, violations

ROOT = Path(__file__).resolve().parent.parent
P = "miles_env"
CONTRACTS = {
    f"{P}.types",
    f"{P}.errors",
    f"{P}.environment",
    f"{P}.sandbox",
    f"{P}.harness",
    f"{P}.engines.base",
}
PLUGIN_FAMILIES = (f"{P}.sandboxes", f"{P}.harnesses", f"{P}.engines", f"{P}.adapters")
FRAMEWORKS = {"verifiers", "hud", "nemo_gym", "openenv", "harbor"}
# what envs/* use besides the contracts: checks, make_task, the guards' setup helpers (scrub_git)
AUTHORING_KIT = {f"{P}.checks", f"{P}.registry", f"{P}.guards"}


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _project(module: str) -> bool:
    return _in(module, P) or module.startswith("miles_env_")


CORE_PACKAGES = ("cli", "queue", "job")  # core split into folders by family (the rest are plug-ins or tools)


def _is_core(module: str) -> bool:
    rest = module.removeprefix(P + ".")
    return module != P and _in(module, P) and ("." not in rest or rest.split(".")[0] in CORE_PACKAGES)


def _queue_backend(module: str) -> str | None:
    """'sqlite' or 'redis' for a module of that queue backend (sqlite.py, sqlite_db.py, redis_scripts.py...)."""
    if not _in(module, f"{P}.queue"):
        return None
    last = module.rpartition(".")[2]
    return next((b for b in ("sqlite", "redis") if last == b or last.startswith(b + "_")), None)


def _is_plugin_impl(module: str) -> bool:
    """A plug-in's implementation: not the family's lookup package, its contract or a config model
    (a `config`, `configs` or `*_config` module, such as sandboxes/fleet_config.py)."""
    last = module.rpartition(".")[2]
    return (
        _in(module, *PLUGIN_FAMILIES)
        and module not in PLUGIN_FAMILIES
        and module not in CONTRACTS
        and last not in ("config", "configs")
        and not last.endswith("_config")
    )


RULES = [
    Rule(
        "the contracts import nothing from the rest of the project",
        importer=lambda m: m in CONTRACTS,
        forbidden=lambda t: _project(t) and t not in CONTRACTS,
        kinds=frozenset({"module", "lazy", "typing"}),
    ),
    Rule(
        "core never imports a sandbox provider, a harness, an engine or an adapter at module level",
        importer=_is_core,
        forbidden=_is_plugin_impl,
        kinds=ON_IMPORT,
    ),
    Rule(
        "the queue's backends depend on the contract, never on each other; the contract on no backend",
        importer=lambda m: _in(m, f"{P}.queue") and m != f"{P}.queue.config",
        forbidden=lambda t: _queue_backend(t) is not None,
        kinds=frozenset({"module", "lazy", "typing"}),
        allow=lambda importer, target: _queue_backend(importer) == _queue_backend(target),
    ),
    Rule(
        "miles_env.tito depends on the Engine contract only, never on a concrete engine",
        importer=lambda m: _in(m, f"{P}.tito"),
        forbidden=lambda t: _in(t, f"{P}.engines") and t not in CONTRACTS,
    ),
    Rule(
        "miles_env.trainer never imports the proxy, the engines or the sandboxes",
        importer=lambda m: _in(m, f"{P}.trainer"),
        forbidden=lambda t: _in(t, f"{P}.tito", f"{P}.engines", f"{P}.sandboxes", f"{P}.harnesses"),
    ),
    Rule(
        "the engine side may import the trainer's weight-delta format, nothing else of the trainer",
        importer=lambda m: _in(m, f"{P}.engines"),
        forbidden=lambda t: _in(t, f"{P}.trainer") and t != f"{P}.trainer.weight_delta",
    ),
    Rule(
        "environments (envs/*) depend on the contracts and the authoring kit only",
        importer=lambda m: m.startswith("miles_env_"),
        forbidden=lambda t: _in(t, P) and t not in CONTRACTS | AUTHORING_KIT,
        kinds=frozenset({"module", "lazy", "typing"}),
    ),
    Rule(
        "harnesses talk to the model only through an Endpoint, never to an engine or the proxy",
        importer=lambda m: _in(m, f"{P}.harnesses"),
        forbidden=lambda t: _in(t, f"{P}.engines", f"{P}.tito"),
    ),
    Rule(
        "adapters never import a framework package in our process (only their workers, in its venv)",
        importer=lambda m: (
            _in(m, f"{P}.adapters") and not _in(m, f"{P}.adapters.workers", f"{P}.adapters.examples")
        ),
        forbidden=lambda t: t in FRAMEWORKS,
    ),
]


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return all_imports(modules_of(ROOT))


def test_the_tree_is_mapped(imports: list[Import]) -> None:
    modules = modules_of(ROOT)
    for name in (
        f"{P}.tito.proxy",
        f"{P}.trainer.loop",
        f"{P}.sandboxes.local",
        f"{P}.adapters",
        f"{P}.cli.main",
    ):
        assert name in modules, name
    assert any(m.startswith("miles_env_terminal_basics") for m in modules)
    assert len(imports) > 300


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.text[:40])
def test_layering_rule(imports: list[Import], rule: Rule) -> None:
    assert any(rule.importer(imp.importer) for imp in imports), f"no module is subject to {rule.text!r}"
    assert violations(imports, [rule]) == []


def test_every_layering_sentence_has_a_rule() -> None:
    section = (ROOT / "INVARIANTS.md").read_text().split("## Layering", 1)[1].split("\n## ", 1)[0]
    bullets = [b for b in section.split("\n- ")[1:]]
    assert len(bullets) == len(RULES), "INVARIANTS.md's layering bullets and RULES must match one to one"


def test_no_import_cycles(imports: list[Import]) -> None:
    assert cycles(imports) == []


def test_core_imports_no_plugin_implementation() -> None:
    """Transitively, in a fresh interpreter: importing every core module loads no plug-in implementation."""
    core = sorted(m for m in modules_of(ROOT) if _is_core(m))
    code = (
        "import importlib, json, sys\n"
        f"for m in {core!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if _is_plugin_impl(m)] == []
    heavy = {"torch", "transformers", "docker", "e2b", "daytona", "modal", "openai", "anthropic"}
    assert heavy.isdisjoint(loaded)


def test_the_checker_catches_a_planted_violation_and_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "trainer").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "miles_env" = "pkg", "miles_env.trainer" = "pkg/trainer" }\n'
    )
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from miles_env import b\n")
    (pkg / "b.py").write_text("import miles_env.a\n")
    (pkg / "types.py").write_text("def f():\n    from miles_env import a\n")
    (pkg / "c.py").write_text("def f():\n    from miles_env import d\n")  # a circle closed lazily...
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from miles_env import c\n"
    )
    (pkg / "trainer" / "__init__.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from miles_env.tito import x\n"
        "def g():\n    from miles_env.tito.proxy import TitoProxy\n"
    )
    (pkg / "queue").mkdir()
    (pkg / "queue" / "__init__.py").write_text("")
    (pkg / "queue" / "sqlite_db.py").write_text("")
    (pkg / "queue" / "sqlite.py").write_text("from miles_env.queue import sqlite_db\n")  # its own family
    (pkg / "queue" / "redis.py").write_text("def f():\n    from miles_env.queue.sqlite import Q\n")
    found = all_imports(modules_of(tmp_path))
    broken = violations(found, RULES)
    assert any("miles_env.queue.redis:2 imports miles_env.queue.sqlite (lazy)" in v for v in broken)
    assert not any("miles_env.queue.sqlite:" in v for v in broken)
    assert any("miles_env.types:2 imports miles_env.a (lazy)" in v for v in broken)
    assert any("miles_env.trainer:5 imports miles_env.tito.proxy (lazy)" in v for v in broken)
    assert not any("(typing)" in v and "trainer" in v for v in broken)  # type-only imports never run
    assert cycles(found) == [["miles_env.a", "miles_env.b"], ["miles_env.c", "miles_env.d"]]
    assert cycles(found, ON_IMPORT) == [["miles_env.a", "miles_env.b"]]  # ...that an import-time check misses


def test_readme_layout_table_matches_the_folders() -> None:
    """Every folder of the package (the mapped roots and their subfolders) has its row, and every row exists."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("| folder | import name | what |", 1)[1].split("\n\n", 1)[0]
    rows = {line.split("`")[1].rstrip("/") for line in table.splitlines() if line.startswith("| `")}
    roots = ["miles_env", "sandboxes", "tito", "trainer", "adapters"]
    folders = set(roots) | {
        f"{root}/{d.name}"
        for root in roots
        for d in (ROOT / root).iterdir()
        if d.is_dir() and d.name != "__pycache__" and not d.name.startswith(".")
    }
    assert folders - rows == set(), "folders missing from README's layout table"
    missing = {r for r in rows if "*" not in r and not (ROOT / r).is_dir()}
    assert missing == set(), "README's layout table names folders that do not exist"
