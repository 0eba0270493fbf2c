"""The real Claude Code CLI as a harness: in the bwrap sandbox, under the TITO proxy.

Scripted policy (real SmolLM2 tokenizer): two Bash tool calls then a final answer;
the verifier passes, the audit finds no drift, and every mask-1 token is exactly
what the engine produced. Then the real SmolLM2 engine: the episode ends with a
status and a trajectory, whatever the model does. The helpers here are shared by
tests/test_harness_codex.py and tests/test_harness_faults.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from miles_env.tito import audit

from miles_env.engines.scripted import PolicyRule, ScriptedEngine, ScriptedPolicy
from miles_env.harnesses import get_harness
from miles_env.harnesses._cli import CLAUDE_CODE, CODEX, TESTED, CliPackage, cli_cache_root
from miles_env.models import load_tokenizer
from miles_env.registry import load_environment
from miles_env.rollout import run_episode
from miles_env.stack import StackConfig, open_stack
from miles_env.types import Episode, Status, Task
from tests.test_tito_support import check_fidelity

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


def require_cli(pkg: CliPackage) -> None:
    """Install the pin with scripts/install-clis.sh; skip (saying why) only when npm or pip cannot."""
    if (cli_cache_root() / f"{pkg.name}-{pkg.version}" / ".complete").exists():
        return
    npm = pkg.name != "mini-swe-agent"  # the one pip-installed harness (its own venv)
    if npm and shutil.which("npm") is None:
        pytest.skip(f"{pkg.package} is not installed and npm is not on PATH")
    proc = subprocess.run(
        [str(ROOT / "scripts" / "install-clis.sh"), f"{pkg.name}@{pkg.version}"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        print(f"install-clis.sh failed: {proc.stderr[-2000:]}")
        pytest.skip(
            f"{'npm' if npm else 'pip'} could not install {pkg.package}@{pkg.version} (registry unreachable?)"
        )


def two_step_task() -> Task:
    """A terminal-basics task whose checks need two separate commands (two files)."""
    checks = [
        {"kind": "file_equals", "path": "first.txt", "text": "alpha", "strip": True},
        {"kind": "file_equals", "path": "second.txt", "text": "alpha beta", "strip": True},
    ]
    return Task(
        id="two-step",
        env="terminal-basics",
        instruction="Write alpha into first.txt, then write the content of first.txt followed by ' beta' into second.txt.",
        verifier={"checks": checks},
    )


def task_for(pin: CliPackage) -> Task:
    """two_step_task() in a sandbox with the address space `pin` needs (Resources.memory_mb)."""
    task = two_step_task()
    resources = task.sandbox.resources.model_copy(update={"memory_mb": pin.memory_mb})
    return task.model_copy(update={"sandbox": task.sandbox.model_copy(update={"resources": resources})})


TWO_STEP_POLICY = ScriptedPolicy(
    (
        PolicyRule(
            "first.txt",
            (
                {"text": "I will create the first file.", "shell": "echo alpha > first.txt"},
                {"shell": 'echo "$(cat first.txt) beta" > second.txt'},
                "Both files are written.",
            ),
        ),
    )
)


async def run_one(
    harness: str,
    engine: Any,
    store: Path,
    task: Task | None = None,
    tito: dict[str, Any] | None = None,
    sandbox_root: Path | None = None,
    **harness_cfg: Any,
) -> Episode:
    env = load_environment("terminal-basics")
    sandbox = {"provider": "local", "root_dir": str(sandbox_root)} if sandbox_root else {}
    cfg = StackConfig(engine={"kind": "scripted"}, tito=tito or {}, store_dir=store, sandbox=sandbox)
    async with open_stack(cfg, engine=engine) as st:
        return await run_episode(
            st.rollout_context(env, get_harness(harness, **harness_cfg)), task or two_step_task()
        )


def check_exact(ep: Episode, engine: ScriptedEngine, store: Path) -> None:
    """Audit clean; every mask-1 token is an engine output id with its logprob, mask 0 elsewhere."""
    report = audit(store)
    assert report.sessions == 1 and not report.drifts, report.drifts
    assert ep.samples and sum(s.n_sampled for s in ep.samples) > 0
    check_fidelity(ep.samples, engine, ep.metadata["session_id"])
    gens = [c.generation for c in engine.calls]
    assert sum(len(g.output_ids) for g in gens) == sum(sum(s.loss_mask) for s in ep.samples)


# Claude Code 2.0's Bash tool asks the model on the side (its "small fast model", same base URL):
# which file paths a command read (after each command), and the prefix of a command that is not
# plainly safe (a permission pre-flight, even with --dangerously-skip-permissions). 2.1 asks neither.
SIDE_CALLS = {
    "Extract any file paths that this command reads or modifies": "<filepaths>\n</filepaths>",
    "Your task is to process Bash commands that an AI coding agent wants to run": "none",
}


def side_call(prompt: str) -> str | None:
    return next((reply for mark, reply in SIDE_CALLS.items() if mark in prompt), None)


class SideCallEngine(ScriptedEngine):
    """The scripted policy for the agent's turns; a fixed answer to Claude Code 2.0's side calls,
    which run concurrently with the agent's turns and so must not advance the policy."""

    def _next_ids(self, session_id: str | None, input_ids: Sequence[int] = ()) -> list[int]:
        reply = side_call(self.tokenizer.decode(list(input_ids[:200])))
        return self._encode_reply(reply) if reply is not None else super()._next_ids(session_id, input_ids)


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


@pytest.mark.slow
@pytest.mark.model
async def test_claude_code_real_smollm2_keeps_the_pipeline(tmp_path: Path) -> None:
    require_cli(CLAUDE_CODE)
    from miles_env.engines import HFEngineConfig, build_engine
    from tests.test_tito_sessions import _Recording

    engine = _Recording(await build_engine(HFEngineConfig(max_batch_size=1)))
    # Only the Bash tool, so the prompt (~3.2k tokens) fits SmolLM2's 8k context; 96 sampled tokens at most.
    tito = {"budget": {"max_tokens": 96}}
    try:
        ep = await run_one(
            "claude-code", engine, tmp_path / "store", tito=tito, budget_s=240, max_turns=2, tools="Bash"
        )
    finally:
        await engine.close()
    assert ep.status in (Status.COMPLETED, Status.TRUNCATED, Status.ABORTED), ep.error
    assert ep.reward is not None  # the verifier graded whatever the model did
    assert "exit_code" in ep.metadata["harness"]
    if engine.calls:  # the model was reached: its tokens are in the trajectory, exactly
        check_fidelity(ep.samples, engine, ep.metadata["session_id"])
        assert not audit(tmp_path / "store").drifts
    print(f"claude-code + SmolLM2: {ep.status} {ep.error} calls={len(engine.calls)} reward={ep.reward}")


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
