"""Faults of the CLI harnesses: hang, crash, missing binary, missing npm; and LocalSandbox.mount_ro.

Each fault ends as a TRUNCATED or ABORTED episode (never an exception), keeps the
turns the proxy recorded before it, leaves no process of the sandbox alive, and
removes the sandbox directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from miles_env.engines.scripted import PolicyRule, ScriptedEngine, ScriptedPolicy
from miles_env.errors import HarnessError, SandboxError
from miles_env.harnesses._cli import CLAUDE_CODE, CODEX, CliPackage, ensure_cli
from miles_env.models import load_tokenizer
from miles_env.types import SandboxSpec, Status
from tests.cli_harness_support import require_cli, run_one

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


MARK = "miles-fault-sleeper"


def _policy(command: str) -> ScriptedPolicy:
    return ScriptedPolicy((PolicyRule(None, ({"shell": command}, "never reached")),))


def _host_procs(pattern: str) -> list[str]:
    """Host processes whose command line holds `pattern` (read-only check; kills nothing)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pattern in args and "pytest" not in args:
            found.append(f"{proc.name} {args}")
    return found


def _assert_clean(root: Path) -> None:
    assert not any(root.iterdir()), list(root.iterdir())  # the sandbox directory is gone
    assert not _host_procs(MARK)


@pytest.mark.slow
@pytest.mark.parametrize("harness", ["claude-code", "codex"])
async def test_budget_kills_a_hung_tool_call(harness: str, tok: Any, tmp_path: Path) -> None:
    """The model asks for a command that never ends: the budget kills the CLI, the first turn stays."""
    require_cli(CLAUDE_CODE if harness == "claude-code" else CODEX)
    engine = ScriptedEngine(tok, policy=_policy(f"exec -a {MARK} sleep 600"), max_context=1 << 20)
    root = tmp_path / "sandboxes"
    ep = await run_one(harness, engine, tmp_path / "store", sandbox_root=root, budget_s=6)
    assert ep.status is Status.TRUNCATED and "budget" in (ep.error or ""), ep.error
    assert ep.metadata["harness"]["timed_out"] is True
    assert len(engine.generations) == 1 and ep.samples and len(ep.samples[0].turns) == 1
    assert (
        ep.samples[0].token_ids[-len(engine.generations[0].output_ids) :] == engine.generations[0].output_ids
    )
    _assert_clean(root)


@pytest.mark.slow
@pytest.mark.parametrize("harness", ["claude-code", "codex"])
async def test_cli_killed_mid_episode_is_aborted(harness: str, tok: Any, tmp_path: Path) -> None:
    """The CLI process dies by SIGKILL after its first model call: ABORTED, the sampled turn kept."""
    require_cli(CLAUDE_CODE if harness == "claude-code" else CODEX)
    kill = "kill -9 $PPID"  # the tool's shell is a child of the CLI (pid 2 of the sandbox's namespace)
    engine = ScriptedEngine(tok, policy=_policy(kill), max_context=1 << 20)
    root = tmp_path / "sandboxes"
    ep = await run_one(harness, engine, tmp_path / "store", sandbox_root=root, budget_s=60)
    assert ep.status is Status.ABORTED, (ep.status, ep.error)
    assert ep.metadata["harness"]["exit_code"] != 0
    assert len(engine.generations) == 1 and len(ep.samples[0].turns) == 1
    _assert_clean(root)


@pytest.mark.parametrize("harness", ["claude-code", "codex"])
async def test_missing_or_crashing_binary(harness: str, tok: Any, tmp_path: Path) -> None:
    require_cli(CLAUDE_CODE if harness == "claude-code" else CODEX)
    root = tmp_path / "sandboxes"
    cases = (("/nonexistent/agent", 127, "No such file"), ("/bin/false", 1, "status 1"))
    for i, (binary, code, says) in enumerate(cases):  # a failed execvp is 127, as a shell reports it
        engine = ScriptedEngine(tok, max_context=1 << 20)
        ep = await run_one(harness, engine, tmp_path / f"store{i}", sandbox_root=root, binary=binary)
        assert ep.status is Status.ABORTED and says in (ep.error or ""), ep.error
        assert ep.metadata["harness"]["exit_code"] == code and not engine.calls and ep.reward is not None
        _assert_clean(root)


async def test_missing_npm_names_the_missing_piece(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # neither node nor npm
    pkg = CliPackage("fake", "@example/fake-cli", "1.0.0", "bin/fake")
    with pytest.raises(HarnessError, match=r"@example/fake-cli@1\.0\.0.*node and npm are not on PATH"):
        await ensure_cli(pkg, cache_root=tmp_path / "cache")
    assert not (tmp_path / "cache" / "fake-1.0.0" / ".complete").exists()


async def test_cached_install_is_used_without_npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = CliPackage("fake", "@example/fake-cli", "1.0.0", "bin/fake")
    target = tmp_path / "fake-1.0.0"
    target.mkdir()
    (target / ".complete").touch()
    monkeypatch.setenv("PATH", str(tmp_path))
    assert await ensure_cli(pkg, cache_root=tmp_path) == target


async def test_episode_without_npm_fails_with_the_reason(
    tok: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"  # what the sandbox provider needs on PATH, and no node/npm
    bin_dir.mkdir()
    for tool in ("prlimit", "bwrap"):
        if found := shutil.which(tool):
            os.symlink(found, bin_dir / tool)
    monkeypatch.setenv("MILES_ENV_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PATH", str(bin_dir))
    root = tmp_path / "sandboxes"
    ep = await run_one("codex", ScriptedEngine(tok), tmp_path / "store", sandbox_root=root)
    assert ep.status is Status.FAILED and "npm" in (ep.error or ""), ep.error
    _assert_clean(root)


async def test_mount_ro_is_visible_read_only_and_checked(tmp_path: Path) -> None:
    from miles_env.sandboxes.local import LocalSandboxProvider
    from miles_env.sandboxes.local.config import LocalSandboxConfig

    src = tmp_path / "tool"
    src.mkdir()
    (src / "hello.sh").write_text("#!/bin/sh\necho hello from the mount\n")
    (src / "hello.sh").chmod(0o755)
    provider = LocalSandboxProvider(LocalSandboxConfig(root_dir=str(tmp_path / "sb")))
    async with await provider.create(SandboxSpec()) as sb:
        sb.mount_ro(str(src), "/.miles-cli/tool")
        r = await sb.exec("/.miles-cli/tool/hello.sh && touch /.miles-cli/tool/x", timeout=10)
        assert r.stdout == "hello from the mount\n" and r.exit_code != 0  # runs, but cannot be written
        assert not (src / "x").exists()
        for bad in ("relative", "/", "/workspace", "/tmp"):
            with pytest.raises(SandboxError, match="inner path"):
                sb.mount_ro(str(src), bad)
        with pytest.raises(SandboxError, match="does not exist"):
            sb.mount_ro(str(tmp_path / "missing"), "/.miles-cli/missing")
    assert not any((tmp_path / "sb").iterdir())  # closed: the sandbox directory is gone


@pytest.mark.slow
async def test_budget_kills_a_cli_waiting_on_a_hung_model(tok: Any, tmp_path: Path) -> None:
    """The engine never answers in time: the CLI is killed by the budget while it waits on the session."""
    require_cli(CODEX)
    engine = ScriptedEngine(tok, max_context=1 << 20, delay_s=30)
    root = tmp_path / "sandboxes"
    ep = await run_one("codex", engine, tmp_path / "store", sandbox_root=root, budget_s=4)
    assert ep.status is Status.TRUNCATED and ep.metadata["harness"]["timed_out"] is True, ep.error
    assert ep.timings["harness_s"] < 15 and ep.reward is not None
    _assert_clean(root)
