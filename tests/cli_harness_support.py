"""Shared helpers for the real-CLI harness tests (a helpers module, not a test module).

Every CLI harness test (claude-code, codex, opencode, mini-swe-agent, the long-episode and fault
tests, the browser view test) runs the same episode: `two_step_task()` (two files, two commands)
under `TWO_STEP_POLICY` (a scripted policy issuing those two shell calls, then an answer), with the
CLI installed at its tested pin by `require_cli` and the episode run through a real stack by
`run_one`. `check_exact` then asserts what every such test must: a clean audit and every mask-1
token the engine's own output. `SideCallEngine` answers Claude Code 2.0's side calls without
advancing the policy.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from miles_env.engines.scripted import PolicyRule, ScriptedEngine, ScriptedPolicy
from miles_env.harnesses import get_harness
from miles_env.harnesses._cli import CliPackage, cli_cache_root
from miles_env.registry import load_environment
from miles_env.rollout import run_episode
from miles_env.stack import StackConfig, open_stack
from miles_env.tito import audit
from miles_env.types import Episode, Task
from tests.tito_support import check_fidelity

__all__ = [
    "ROOT",
    "SIDE_CALLS",
    "TWO_STEP_POLICY",
    "SideCallEngine",
    "check_exact",
    "require_cli",
    "run_one",
    "side_call",
    "task_for",
    "two_step_task",
]

ROOT = Path(__file__).resolve().parents[1]


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
