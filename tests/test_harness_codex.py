"""The real Codex CLI as a harness: in the bwrap sandbox, under the TITO proxy (Responses API).

Same checks as tests/test_harness_claude_code.py: a scripted policy with two
exec_command calls passes the verifier with an exact, drift-free trajectory. (Codex on a
model through the hf engine, full and trimmed: tests/test_harness_docs.py.)
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from miles_env.engines.scripted import ScriptedEngine
from miles_env.harnesses import get_harness
from miles_env.harnesses._cli import CODEX, TESTED, CliPackage
from miles_env.harnesses.codex import CodexHarness, codex_config_toml, parse_events
from miles_env.models import load_tokenizer
from miles_env.types import Status
from tests.cli_harness_support import (
    TWO_STEP_POLICY,
    check_exact,
    require_cli,
    run_one,
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
@pytest.mark.parametrize("pin", TESTED["codex"], ids=lambda p: p.version)
async def test_codex_scripted_two_tool_calls(pin: CliPackage, tok: Any, tmp_path: Path) -> None:
    """Every tested Codex version (today's pin and the previous minor on npm)."""
    require_cli(pin)
    engine = ScriptedEngine(tok, policy=TWO_STEP_POLICY, max_context=1 << 20)
    ep = await run_one("codex", engine, tmp_path / "store", task_for(pin), budget_s=150, version=pin.version)
    assert ep.status is Status.COMPLETED, (ep.error, ep.metadata["harness"])
    assert ep.reward is not None and ep.reward.passed, ep.reward
    assert ep.metadata["harness"]["version"] == pin.version
    events = ep.metadata["harness"]["output"]
    commands = [
        e["item"]
        for e in events
        if e.get("type") == "item.completed" and e["item"]["type"] == "command_execution"
    ]
    assert [c["exit_code"] for c in commands] == [0, 0] and "first.txt" in commands[0]["command"]
    assert ep.metadata["transcript"][-1] == {"role": "assistant", "content": "Both files are written."}
    assert len(engine.generations) == 3
    # The shell tool Codex offers is exec_command(cmd): the policy's calls used it.
    assert '"name": "exec_command"' in tok.decode(list(engine.calls[0].input_ids))
    check_exact(ep, engine, tmp_path / "store")


def test_config_toml_points_at_the_session() -> None:
    cfg = tomllib.loads(
        codex_config_toml("http://127.0.0.1:41000/s/abc/v1", "policy", 'model_verbosity = "low"')
    )
    assert cfg["model_provider"] == "tito" and cfg["model"] == "policy"
    provider = cfg["model_providers"]["tito"]
    assert provider["base_url"] == "http://127.0.0.1:41000/s/abc/v1" and provider["wire_api"] == "responses"
    assert provider["env_key"] == "TITO_API_KEY" and cfg["model_verbosity"] == "low"
    h = get_harness("codex", budget_s=3)
    assert isinstance(h, CodexHarness) and h.config.budget_s == 3
    argv = h.argv(two_step_task())
    assert argv[0] == CODEX.inner(CODEX.binary) and argv[-1] == two_step_task().instruction
    assert "--json" in argv and "--skip-git-repo-check" in argv


def test_parse_events_skips_non_json() -> None:
    out = 'warning: x\n{"type": "turn.started"}\n{broken\n{"type": "turn.completed"}\n'
    assert [e["type"] for e in parse_events(out)] == ["turn.started", "turn.completed"]


def test_failure_message_comes_from_codex_events() -> None:
    from miles_env.harnesses.codex import _failure

    events = [{"type": "turn.started"}, {"type": "turn.failed", "error": {"message": "stream disconnected"}}]
    assert _failure(events) == "stream disconnected" and _failure(events[:1]) is None
