"""The real Claude Code CLI as a harness: in the bwrap sandbox, under the TITO proxy.

Scripted policy (real SmolLM2 tokenizer): two Bash tool calls then a final answer;
the verifier passes, the audit finds no drift, and every mask-1 token is exactly
what the engine produced. (Claude Code on the real SmolLM2 is the documented command of
tests/test_harness_docs.py.) The helpers every CLI harness test shares live in
tests/cli_harness_support.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from miles_env.harnesses import get_harness
from miles_env.harnesses._cli import CLAUDE_CODE, CODEX, TESTED, CliPackage
from miles_env.models import load_tokenizer
from miles_env.types import Status
from tests.cli_harness_support import (
    ROOT,
    TWO_STEP_POLICY,
    SideCallEngine,
    check_exact,
    require_cli,
    run_one,
    side_call,
    task_for,
    two_step_task,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


@pytest.mark.slow
@pytest.mark.parametrize("pin", TESTED["claude-code"], ids=lambda p: p.version)
async def test_claude_code_scripted_two_tool_calls(pin: CliPackage, tok: Any, tmp_path: Path) -> None:
    """Every tested Claude Code version (today's pin and the previous minor's newest patch)."""
    require_cli(pin)
    engine = SideCallEngine(tok, policy=TWO_STEP_POLICY, max_context=1 << 20)
    ep = await run_one(
        "claude-code", engine, tmp_path / "store", task_for(pin), budget_s=150, version=pin.version
    )
    assert ep.status is Status.COMPLETED, (ep.error, ep.metadata["harness"])
    assert ep.reward is not None and ep.reward.passed, ep.reward
    meta = ep.metadata["harness"]
    assert meta["exit_code"] == 0 and meta["version"] == pin.version and meta["output"]["num_turns"] == 3
    assert meta["output"]["result"] == "Both files are written."
    prompts = [tok.decode(list(c.input_ids)) for c in engine.calls]
    turns = [p for p in prompts if side_call(p) is None]
    assert len(turns) == 3  # two tool calls and the answer; no warm-up or title request
    # 2.1 makes no other call; 2.0 its side calls (at least a file-path call per command), which the
    # session records like any turn (check_exact below covers them too).
    side = len(prompts) - len(turns)
    assert side >= 2 if pin.version.startswith("2.0.") else side == 0, side
    # The second prompt holds the first command's result, sent back by Claude Code as a tool_result.
    assert "<tool_response>" in turns[1]
    check_exact(ep, engine, tmp_path / "store")


def test_registry_and_argv() -> None:
    from miles_env.harness import Endpoint
    from miles_env.harnesses.claude_code import ClaudeCodeHarness

    h = get_harness("claude-code", budget_s=5, max_turns=3, tools="Bash")
    assert isinstance(h, ClaudeCodeHarness)
    ep = Endpoint("http://h/s/x/v1", "k", "x", "policy", "http://h/s/x")
    argv = h.argv(two_step_task(), ep)
    assert argv[0] == CLAUDE_CODE.inner(CLAUDE_CODE.binary) and argv[1:3] == [
        "-p",
        two_step_task().instruction,
    ]
    assert argv[argv.index("--max-turns") + 1] == "3" and argv[argv.index("--tools") + 1] == "Bash"
    env = h.env("http://127.0.0.1:9/s/x", ep)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9/s/x" and env["ANTHROPIC_API_KEY"] == "k"
    assert env["DISABLE_TELEMETRY"] == env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert CODEX.version and os.sep not in CLAUDE_CODE.name


def test_tested_pins_match_the_install_script() -> None:
    """scripts/install-clis.sh installs exactly the tested pins, default first; each pin is selectable."""
    from miles_env.errors import ConfigError
    from miles_env.harnesses._cli import tested_pin

    script = (ROOT / "scripts" / "install-clis.sh").read_text()
    for name, pins in TESTED.items():
        var = name.upper().replace("-", "_") + "_VERSIONS"
        found = re.search(rf'^{var}="\$\{{{var}:-([^}}]*)\}}"', script, re.M)
        assert found is not None, var
        assert found.group(1).split() == [p.version for p in pins], name
        assert {p.name for p in pins} == {name} and len({p.version for p in pins}) == len(pins)
        assert tested_pin(name) is pins[0] and all(tested_pin(name, p.version) is p for p in pins)
    assert TESTED["claude-code"][0] is CLAUDE_CODE and TESTED["codex"][0] is CODEX
    with pytest.raises(ConfigError, match=r"claude-code version '9\.9\.9' is not a tested pin"):
        get_harness("claude-code", version="9.9.9")


def test_out_of_address_space_names_the_memory_the_pin_needs() -> None:
    from miles_env.harnesses._cli import OPENCODE, CliRun, cli_status

    crash = CliRun(
        ("x",), -6, "", "ASSERTION FAILED: MemoryExhaustion: Crash intentionally", False, None, 1.0, 0.0
    )
    status, error = cli_status(crash, OPENCODE)
    assert status is Status.ABORTED and "Resources.memory_mb >= 6144" in (error or "")
    killed = CliRun(("x",), 137, "", "", False, "memory", 1.0, 0.0)
    assert "memory_mb >= 6144" in (cli_status(killed, OPENCODE)[1] or "")
    other = CliRun(("x",), 1, "", "usage: x", False, None, 1.0, 0.0)
    assert cli_status(other, OPENCODE) == (Status.ABORTED, "CLI exited with status 1: usage: x")
