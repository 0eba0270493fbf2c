"""The `mini-swe-agent` harness: the real mini-swe-agent (PyPI), unmodified, acting inside the sandbox.

Lifecycle of one run: install (cached: a venv built from locks/mini-swe-agent.txt)
-> mount the venv read-only -> expose the TITO session's `/v1` inside the sandbox
-> `python -m minisweagent.run.mini -y --exit-immediately` with model
`openai/<model>` at that base URL (litellm's OpenAI provider, key in
OPENAI_API_KEY) -> exit status and the agent's saved trajectory into the metadata.

mini-swe-agent 2 asks for a `bash` tool call each step (OpenAI chat completions
with tools) and runs each command in a fresh subshell in its working directory,
the sandbox's workdir; it finishes when a command prints
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT. Offline on purpose: litellm uses its
bundled cost map (LITELLM_LOCAL_MODEL_COST_MAP), cost tracking ignores the
unknown model, the first-run setup prompt is skipped (MSWEA_CONFIGURED) and a
refused request is not retried (TITO's refusals are final).

Invariant: the venv's base interpreter lies under the host's /usr, /bin or /opt,
which the local sandbox mirrors, so the mounted venv runs inside it unchanged.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio

from miles_env.errors import HarnessError, SandboxError
from miles_env.harness import Endpoint, HarnessResult
from miles_env.harnesses._cli import (
    HOME,
    CliPackage,
    cli_cache_root,
    cli_result,
    cli_status,
    mount_cli,
    policy_end,
    run_cli,
)
from miles_env.harnesses.configs import MiniSweAgentConfig
from miles_env.sandbox import Sandbox
from miles_env.types import Status, Task

__all__ = ["MINI_SWE_AGENT", "LOCK", "MiniSweAgentConfig", "MiniSweAgentHarness", "ensure_venv", "outcome"]

# A venv, not an npm package: `binary` is its interpreter. Keep the version in sync with
# scripts/install-mini-swe-agent.sh and the lock file.
MINI_SWE_AGENT = CliPackage("mini-swe-agent", "mini-swe-agent", "2.4.6", "bin/python")
LOCK = Path(__file__).parent / "locks" / "mini-swe-agent.txt"
TRAJECTORY = f"{HOME}/trajectory.json"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_VISIBLE = ("/usr/", "/bin/", "/opt/")  # host dirs the local sandbox mirrors read-only
# Its exit statuses that the model's output caused: replies in no format it could act on (a missing
# or second tool call), max_consecutive_format_errors times in a row. A policy end (POLICY_FORMAT).
FORMAT_EXITS = frozenset({"RepeatedFormatError"})


def _run_step(argv: list[str], what: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise HarnessError(f"{what} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    return proc.stdout


def _install_blocking(target: Path, python: str) -> Path:
    marker = target / ".complete"
    if marker.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # scripts/install-mini-swe-agent.sh takes the same lock
        if marker.exists():
            return target
        found = shutil.which(python)
        real = os.path.realpath(found) if found else ""
        if not real.startswith(_VISIBLE):
            raise HarnessError(
                f"mini-swe-agent: interpreter {python!r} ({real or 'not found'}) is not under "
                f"{', '.join(_VISIBLE)}, which the sandbox mirrors; set python=/usr/bin/python3"
            )
        wanted = re.search(r"Python (\d+\.\d+)", LOCK.read_text().splitlines()[0])
        have = _run_step([real, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], python).strip()
        if wanted and wanted.group(1) != have:
            raise HarnessError(
                f"mini-swe-agent: {LOCK} was resolved for Python {wanted.group(1)}, {python} is {have}"
            )
        shutil.rmtree(target, ignore_errors=True)
        py = str(target / "bin" / "python")
        _run_step([real, "-m", "venv", str(target)], f"{python} -m venv {target}")
        pip = [py, "-m", "pip", "--disable-pip-version-check"]
        _run_step([*pip, "install", "--quiet", "--no-deps", "-r", str(LOCK)], f"pip install -r {LOCK}")
        _run_step([*pip, "check"], "pip check")
        marker.touch()
    return target


async def ensure_venv(python: str = "/usr/bin/python3", *, cache_root: Path | None = None) -> Path:
    """The venv of the pinned mini-swe-agent, built from the lock file first if needed (HarnessError if not)."""
    target = (cache_root or cli_cache_root()) / f"{MINI_SWE_AGENT.name}-{MINI_SWE_AGENT.version}"
    return await anyio.to_thread.run_sync(_install_blocking, target, python)


def outcome(trajectory: dict[str, Any] | None) -> tuple[Status, str | None]:
    """The episode status from the agent's own exit status (in its saved trajectory)."""
    info = (trajectory or {}).get("info", {})
    exit_status = str(info.get("exit_status") or "")
    if exit_status == "Submitted":
        return Status.COMPLETED, None
    if exit_status in ("LimitsExceeded", "TimeExceeded"):
        return Status.TRUNCATED, f"mini-swe-agent stopped: {exit_status}"
    last = ((trajectory or {}).get("messages") or [{}])[-1]
    detail = str(last.get("extra", {}).get("exception_str") or last.get("content") or "")[:400]
    if "budget_exceeded" in detail or "session budget" in detail:
        return Status.TRUNCATED, f"budget: {detail}"
    if exit_status in FORMAT_EXITS:
        return Status.ABORTED, f"mini-swe-agent gave up on the model's replies ({exit_status}): {detail}"
    return Status.ABORTED, f"mini-swe-agent exit status {exit_status or 'unknown'}: {detail}"


def _steps(trajectory: dict[str, Any]) -> list[dict[str, Any]]:
    """(command, returncode) of each executed action, in order."""
    out = []
    for msg in trajectory.get("messages", []):
        extra = msg.get("extra") or {}
        for action in extra.get("actions", []) if msg.get("role") == "assistant" else []:
            out.append({"command": action.get("command")})
        if msg.get("role") == "tool" and out and "returncode" not in out[-1]:
            out[-1]["returncode"] = extra.get("returncode")
    return out


class MiniSweAgentHarness:
    name = "mini-swe-agent"

    def __init__(self, config: MiniSweAgentConfig | None = None, **overrides: Any) -> None:
        base = (config or MiniSweAgentConfig()).model_dump()
        self.config = MiniSweAgentConfig(**{**base, **overrides})
        self.pin = MINI_SWE_AGENT

    def argv(self, task: Task, endpoint: Endpoint, inner_v1: str) -> list[str]:
        cfg = self.config
        specs = [
            "mini.yaml",
            f"model.model_kwargs.api_base={inner_v1}",
            "agent.cost_limit=0",
            f"agent.step_limit={cfg.step_limit}",
            f"environment.timeout={cfg.command_timeout_s}",
            *cfg.extra_config,
        ]
        argv = [*self.pin.command(cfg.binary), "-m", "minisweagent.run.mini", "-y", "--exit-immediately"]
        for spec in specs:
            argv += ["-c", spec]
        return argv + ["-m", f"openai/{endpoint.model}", "-o", TRAJECTORY, "-t", task.instruction]

    def env(self, endpoint: Endpoint) -> dict[str, str]:
        return {
            "PATH": DEFAULT_PATH,
            "HOME": HOME,
            "OPENAI_API_KEY": endpoint.api_key,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "MSWEA_CONFIGURED": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": f"{HOME}/.config/mini-swe-agent",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
            "MSWEA_SILENT_STARTUP": "1",
            "NO_COLOR": "1",
            "TERM": "dumb",
            "PYTHONDONTWRITEBYTECODE": "1",
            **self.config.extra_env,
        }

    async def _trajectory(self, sandbox: Sandbox) -> dict[str, Any] | None:
        try:
            data = json.loads(await sandbox.read_file(TRAJECTORY))
        except (SandboxError, OSError, json.JSONDecodeError):
            return None  # the agent died before saving one
        return data if isinstance(data, dict) else None

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint) -> HarnessResult:
        t0 = time.time()
        install_dir = await ensure_venv(self.config.python)
        mount_cli(sandbox, self.pin, install_dir)
        inner_v1 = await sandbox.expose(endpoint.base_url)
        await sandbox.exec(["mkdir", "-p", HOME], timeout=30)
        prepared = time.time()
        run = await run_cli(
            sandbox, self.argv(task, endpoint, inner_v1), self.env(endpoint), self.config.budget_s
        )
        status, error = cli_status(run, self.pin)
        trajectory = await self._trajectory(sandbox)
        info = (trajectory or {}).get("info", {})
        end = None
        if status is not Status.TRUNCATED and trajectory is not None:
            status, error = outcome(trajectory)  # the agent's own account beats a bare exit status
            end = policy_end(str(info.get("exit_status") or ""), FORMAT_EXITS)
        output = {
            "exit_status": info.get("exit_status"),
            "submission": info.get("submission"),
            "api_calls": info.get("model_stats", {}).get("api_calls"),
            "steps": _steps(trajectory or {}),
        }
        said = [m for m in (trajectory or {}).get("messages", []) if m.get("role") == "assistant"]
        return cli_result(
            self.pin, run, status, error, instruction=task.instruction,
            final=said[-1].get("content") if said else None, output=output,
            timing=(t0, prepared), stdout_tail=trajectory is None, end=end,
        )  # fmt: skip
