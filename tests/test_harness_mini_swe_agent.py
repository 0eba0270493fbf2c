"""mini-swe-agent (PyPI) as a harness: in the bwrap sandbox, under the TITO proxy (OpenAI chat via litellm).

Same checks as tests/test_harness_claude_code.py: a scripted policy calls
mini-swe-agent's `bash` tool twice (the two files), then submits with its own
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT command; the verifier passes, the
trajectory is exact and drift-free, and nothing but the agent's turns reached
the model (litellm stays offline).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from miles_env.engines.scripted import PolicyRule, ScriptedEngine, ScriptedPolicy
from miles_env.harness import Endpoint
from miles_env.harnesses import get_harness
from miles_env.harnesses.mini_swe_agent import LOCK, MINI_SWE_AGENT, MiniSweAgentHarness, outcome
from miles_env.models import load_tokenizer
from miles_env.types import Status
from tests.cli_harness_support import ROOT, check_exact, require_cli, run_one, two_step_task

pytestmark = pytest.mark.anyio
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


def bash_call(command: str, text: str = "") -> str:
    """A reply calling mini-swe-agent's `bash` tool (argument `command`) in the hermes format."""
    body = json.dumps({"name": "bash", "arguments": {"command": command}})
    return (text + "\n" if text else "") + f"<tool_call>\n{body}\n</tool_call>"


MINI_POLICY = ScriptedPolicy(
    (
        PolicyRule(
            "first.txt",
            (
                bash_call("echo alpha > first.txt", "I will create the first file."),
                bash_call('echo "$(cat first.txt) beta" > second.txt'),
                bash_call(SUBMIT, "Both files are written."),
            ),
        ),
    )
)


@pytest.mark.slow
async def test_mini_swe_agent_scripted_two_tool_calls(tok: Any, tmp_path: Path) -> None:
    require_cli(MINI_SWE_AGENT)
    engine = ScriptedEngine(tok, policy=MINI_POLICY, max_context=1 << 20)
    ep = await run_one("mini-swe-agent", engine, tmp_path / "store", budget_s=150)
    meta = ep.metadata["harness"]
    assert ep.status is Status.COMPLETED, (ep.error, meta)
    assert ep.reward is not None and ep.reward.passed, ep.reward
    out = meta["output"]
    assert meta["exit_code"] == 0 and out["exit_status"] == "Submitted" and out["api_calls"] == 3
    assert [s["command"] for s in out["steps"][:2]] == [
        "echo alpha > first.txt",
        'echo "$(cat first.txt) beta" > second.txt',
    ]
    assert [s.get("returncode") for s in out["steps"][:2]] == [0, 0]
    assert len(engine.generations) == 3  # two commands and the submission
    assert '"name": "bash"' in tok.decode(list(engine.calls[0].input_ids))
    # The second prompt holds the first command's result, sent back as a tool message.
    assert "<tool_response>" in tok.decode(list(engine.calls[1].input_ids))
    check_exact(ep, engine, tmp_path / "store")


def test_argv_points_litellm_at_the_session() -> None:
    h = get_harness(
        "mini-swe-agent", budget_s=3, step_limit=7, extra_config=("model.model_kwargs.temperature=0",)
    )
    assert isinstance(h, MiniSweAgentHarness)
    ep = Endpoint("http://h/s/x/v1", "k", "x", "policy", "http://h/s/x")
    argv = h.argv(two_step_task(), ep, "http://127.0.0.1:9/s/x/v1")
    assert argv[0] == MINI_SWE_AGENT.inner("bin/python") and argv[1:3] == ["-m", "minisweagent.run.mini"]
    specs = [argv[i + 1] for i, a in enumerate(argv) if a == "-c"]
    assert specs[0] == "mini.yaml" and "model.model_kwargs.api_base=http://127.0.0.1:9/s/x/v1" in specs
    assert "agent.step_limit=7" in specs and specs[-1] == "model.model_kwargs.temperature=0"
    assert argv[argv.index("-m", 3) + 1] == "openai/policy" and argv[-1] == two_step_task().instruction
    env = h.env(ep)
    assert env["OPENAI_API_KEY"] == "k" and env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert env["MSWEA_CONFIGURED"] == "1" and env["MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT"] == "1"


def test_outcome_from_the_agents_exit_status() -> None:
    assert outcome({"info": {"exit_status": "Submitted"}}) == (Status.COMPLETED, None)
    assert outcome({"info": {"exit_status": "LimitsExceeded"}})[0] is Status.TRUNCATED
    budget = {"role": "exit", "extra": {"exception_str": "litellm.BadRequestError: ... budget_exceeded"}}
    assert outcome({"info": {"exit_status": "BadRequestError"}, "messages": [budget]})[0] is Status.TRUNCATED
    crash = {"info": {"exit_status": "RuntimeError"}, "messages": [{"role": "exit", "content": "boom"}]}
    assert outcome(crash) == (Status.ABORTED, "mini-swe-agent exit status RuntimeError: boom")
    # The model's replies held no tool call it could act on, three times in a row: the policy's end.
    garbled = {"info": {"exit_status": "RepeatedFormatError"}, "messages": [{"role": "exit", "content": "x"}]}
    status, error = outcome(garbled)
    assert status is Status.ABORTED and "gave up on the model's replies" in (error or "")


def test_lock_and_script_agree_on_the_pin() -> None:
    """The lock pins the harness's version, and the install script installs that version."""
    lines = LOCK.read_text().splitlines()
    assert lines[0].startswith("# the mini-swe-agent venv") and lines[1].startswith("# Regenerate with:")
    pins = dict(line.split("==", 1) for line in lines[2:] if line)
    assert pins["mini-swe-agent"] == MINI_SWE_AGENT.version and "litellm" in pins
    script = (ROOT / "scripts" / "install-mini-swe-agent.sh").read_text()
    assert re.search(r'^MINI_SWE_AGENT_VERSION="([^"]+)"', script, re.M).group(1) == MINI_SWE_AGENT.version  # type: ignore[union-attr]


async def test_venv_refuses_an_interpreter_the_sandbox_cannot_see(tmp_path: Path) -> None:
    """The venv's base interpreter must lie under the mirrored /usr, /bin or /opt."""
    from miles_env.errors import HarnessError
    from miles_env.harnesses.mini_swe_agent import ensure_venv

    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "python3"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    with pytest.raises(HarnessError, match="not under /usr/"):
        await ensure_venv(str(fake), cache_root=tmp_path / "cache")
    assert not (tmp_path / "cache" / f"mini-swe-agent-{MINI_SWE_AGENT.version}" / ".complete").exists()


def test_doctor_requires_the_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from miles_env.config import RunConfig
    from miles_env.doctor import check_mini_swe_agent, needs

    required = needs(RunConfig(harness={"name": "mini-swe-agent"}))
    assert "mini-swe-agent" in required and "node/npm" not in required
    monkeypatch.setenv("MILES_ENV_CACHE", str(tmp_path))
    check = check_mini_swe_agent()
    assert not check.ok and check.fix == "scripts/install-clis.sh mini-swe-agent"
