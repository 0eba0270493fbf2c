"""The real opencode CLI as a harness: in the bwrap sandbox, under the TITO proxy (OpenAI chat completions).

Same checks as tests/test_harness_claude_code.py: a scripted policy with two
calls of opencode's own `bash` tool passes the verifier with an exact,
drift-free trajectory and no request besides the agent's three turns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from miles_env.engines.scripted import PolicyRule, ScriptedEngine, ScriptedPolicy
from miles_env.errors import ConfigError
from miles_env.harness import Endpoint
from miles_env.harnesses import get_harness
from miles_env.harnesses._cli import OPENCODE, TESTED
from miles_env.harnesses.opencode import OpencodeHarness, failure, final_text, opencode_config, parse_events
from miles_env.models import load_tokenizer
from miles_env.types import Status
from tests.cli_harness_support import check_exact, require_cli, run_one, task_for, two_step_task

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


def bash_call(command: str, text: str = "") -> str:
    """A reply calling opencode's `bash` tool (lower-case, argument `command`) in the hermes format."""
    body = json.dumps({"name": "bash", "arguments": {"command": command, "description": "Run a command"}})
    return (text + "\n" if text else "") + f"<tool_call>\n{body}\n</tool_call>"


OPENCODE_POLICY = ScriptedPolicy(
    (
        PolicyRule(
            "first.txt",
            (
                bash_call("echo alpha > first.txt", "I will create the first file."),
                bash_call('echo "$(cat first.txt) beta" > second.txt'),
                "Both files are written.",
            ),
        ),
    )
)


@pytest.mark.slow
@pytest.mark.parametrize("version", [p.version for p in TESTED["opencode"]])
async def test_opencode_scripted_two_tool_calls(version: str, tok: Any, tmp_path: Path) -> None:
    pin = next(p for p in TESTED["opencode"] if p.version == version)
    require_cli(pin)
    engine = ScriptedEngine(tok, policy=OPENCODE_POLICY, max_context=1 << 20)
    ep = await run_one("opencode", engine, tmp_path / "store", task_for(pin), budget_s=150, version=version)
    meta = ep.metadata["harness"]
    assert ep.status is Status.COMPLETED, (ep.error, meta)
    assert ep.reward is not None and ep.reward.passed, ep.reward
    assert meta["exit_code"] == 0 and meta["version"] == version
    tools = [e["part"] for e in meta["output"] if e.get("type") == "tool_use"]
    assert [t["tool"] for t in tools] == ["bash", "bash"], tools
    assert all(t["state"]["status"] == "completed" for t in tools), tools
    assert final_text(meta["output"]) == "Both files are written."
    assert len(engine.generations) == 3  # two tool calls and the answer; no title request
    prompt = tok.decode(list(engine.calls[0].input_ids))
    assert '"name": "bash"' in prompt and "first.txt" in prompt
    # The second prompt holds the first command's result, sent back as a tool message.
    assert "<tool_response>" in tok.decode(list(engine.calls[1].input_ids))
    check_exact(ep, engine, tmp_path / "store")


def test_config_points_at_the_session() -> None:
    cfg = opencode_config("http://127.0.0.1:41000/s/abc/v1", "policy", output_tokens=512, extra={"x": 1})
    provider = cfg["provider"]["tito"]
    assert cfg["model"] == "tito/policy" and provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {
        "baseURL": "http://127.0.0.1:41000/s/abc/v1",
        "apiKey": "{env:TITO_API_KEY}",
    }
    assert provider["models"]["policy"]["limit"]["output"] == 512 and cfg["x"] == 1
    assert "limit" not in opencode_config("u", "policy")["provider"]["tito"]["models"]["policy"]
    h = get_harness("opencode", budget_s=3)
    assert isinstance(h, OpencodeHarness) and h.pin == OPENCODE
    argv = h.argv(two_step_task())
    assert argv[0] == OPENCODE.inner(OPENCODE.binary) and argv[-1] == two_step_task().instruction
    assert argv[argv.index("--title") + 1] == "two-step" and "--auto" in argv
    ep = Endpoint("http://h/s/x/v1", "k", "x", "policy", "http://h/s/x")
    env = h.env(ep)
    assert env["TITO_API_KEY"] == "k" and env["OPENCODE_CONFIG"] == "/tmp/.agent-home/opencode.json"
    assert env["OPENCODE_DISABLE_AUTOCOMPACT"] == env["OPENCODE_DISABLE_PRUNE"] == "1"
    with pytest.raises(ConfigError, match="not a tested pin"):
        get_harness("opencode", version="0.0.1")


def test_events_final_text_and_failure() -> None:
    out = 'warn\n{"type": "text", "part": {"text": "hi"}}\n{broken\n{"type": "step_finish", "part": {}}\n'
    events = parse_events(out)
    assert [e["type"] for e in events] == ["text", "step_finish"] and final_text(events) == "hi"
    assert failure(events) is None
    body = json.dumps({"error": {"code": "budget_exceeded", "message": "session budget max_turns exceeded"}})
    err = {"type": "error", "error": {"name": "APIError", "data": {"message": "m", "responseBody": body}}}
    assert failure([*events, err]) == ("m", True)
    err["error"]["data"]["responseBody"] = "<html>"  # type: ignore[index]
    assert failure([err]) == ("m", False)


def test_doctor_requires_the_opencode_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from miles_env.config import RunConfig
    from miles_env.doctor import check_opencode, needs

    assert {"node/npm", "opencode"} <= needs(RunConfig(harness={"name": "opencode"}))
    monkeypatch.setenv("MILES_ENV_CACHE", str(tmp_path))
    check = check_opencode()
    assert not check.ok and check.fix == "scripts/install-clis.sh opencode"
