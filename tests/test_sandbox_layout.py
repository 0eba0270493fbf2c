"""The providers' layout: one lookup table, configs importable without any SDK, no sibling's private names.

A provider is a module or subpackage of sandboxes/; what several need lives beside
them (execargs, results, expose, ownership, cloud, the images/ package), so no provider's package is
imported from outside itself and nothing there reaches for another's `_private` name.
Optional capabilities are Protocols (Reapable, AsyncClosable), not attribute probes.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel

from miles_env.errors import ConfigError
from miles_env.sandbox import AsyncClosable, Reapable
from miles_env.sandboxes import PROVIDER_CONFIGS, PROVIDERS, get_provider
from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
from miles_env.sandboxes.pool import SandboxPool

SANDBOXES = Path(__file__).resolve().parents[1] / "sandboxes"
SHARED_PACKAGES = {"images"}  # shared by several providers (task images), like execargs.py
PACKAGES = sorted(
    p.name for p in SANDBOXES.iterdir() if (p / "__init__.py").is_file() and p.name not in SHARED_PACKAGES
)  # local, docker
SDKS = ("docker", "e2b", "daytona", "modal", "agent_env")


def test_the_two_tables_name_the_same_providers() -> None:
    assert PROVIDERS.names() == PROVIDER_CONFIGS.names()
    assert set(PROVIDERS.names()) == {"local", "docker", "e2b", "daytona", "modal", "agentenv"}
    for name in PROVIDERS.names():
        assert PROVIDERS.load(name).name == name
        config = PROVIDER_CONFIGS.load(name)
        assert issubclass(config, BaseModel) and config.model_config.get("extra") == "forbid", name


def test_every_config_class_imports_without_any_sdk() -> None:
    code = textwrap.dedent(
        f"""
        import sys
        from miles_env.sandboxes import PROVIDER_CONFIGS
        from miles_env.sandboxes.fleet_config import FleetConfig  # the run config's `fleet:` section
        for name in PROVIDER_CONFIGS.names():
            PROVIDER_CONFIGS.load(name)()
        FleetConfig()
        print(sorted(m for m in {SDKS!r} if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unknown_provider_and_bad_config_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"sandbox provider 'nope' is unknown; known: agentenv, .*local"):
        get_provider("nope")
    with pytest.raises(ConfigError, match=r"(?s)sandbox provider 'docker': invalid config: .*cpus"):
        get_provider("docker", cpus=-1)  # rejected before the SDK is needed


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, imported names) of every `from X import ...` in `path`."""
    package = ["miles_env", "sandboxes", *path.relative_to(SANDBOXES).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.append((module, [a.name for a in node.names]))
    return found


@pytest.mark.parametrize("path", sorted(SANDBOXES.rglob("*.py")), ids=lambda p: str(p.relative_to(SANDBOXES)))
def test_no_provider_package_is_imported_from_outside_itself(path: Path) -> None:
    rel = path.relative_to(SANDBOXES).parts
    own = rel[0] if len(rel) > 1 else None
    for module, names in _imports(path):
        parts = module.split(".")
        if parts[:2] != ["miles_env", "sandboxes"] or len(parts) < 3:
            continue
        if parts[2] in PACKAGES and parts[2] != own:
            pytest.fail(f"{'/'.join(rel)} imports {module} ({names}): move the shared piece up to sandboxes/")
        if parts[2] != own:
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{'/'.join(rel)} imports private {private} from {module}"


def test_capabilities_are_protocols(tmp_path: Path) -> None:
    local = LocalSandboxProvider(LocalSandboxConfig(root_dir=str(tmp_path / "sb")))
    assert isinstance(local, Reapable) and isinstance(local, AsyncClosable)
    assert isinstance(SandboxPool(local), Reapable)
    e2b = PROVIDERS.load("e2b")(PROVIDER_CONFIGS.load("e2b")(api_key="k"), sdk=object())
    assert isinstance(e2b, Reapable) and not isinstance(e2b, AsyncClosable)
