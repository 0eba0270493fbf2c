"""Harbor's own Trial on our sandbox: the harbor package (its venv) drives, our sandbox executes.

Concept: `run_harbor_trial(task_dir, agent, provider)` creates one of our sandboxes
for the task (the same spec the native reader builds), then asks the harbor worker
to run `Trial.create(TrialConfig(environment.import_path="harbor_env:MilesSandboxEnvironment"))`.
That environment class calls back into this process (`sandbox.exec/write/read/list`)
for every command and file transfer, so Harbor's agent and verifier run in our
sandbox. The reward is Harbor's own `verifier_result.rewards`.

Invariant: callbacks reach only the sandbox registered for the running trial; the
sandbox is closed when the trial returns or fails.
"""

from __future__ import annotations

import base64
import shlex
import tempfile
import uuid
from pathlib import Path
from typing import Any

from miles_env.adapters.harbor import read_task_dir
from miles_env.adapters.harness import worker_for

from miles_env.errors import SandboxError
from miles_env.sandbox import Sandbox, SandboxProvider

__all__ = ["run_harbor_trial"]

_SANDBOXES: dict[str, Sandbox] = {}


def _sandbox(params: dict[str, Any]) -> Sandbox:
    sb = _SANDBOXES.get(str(params.get("sandbox")))
    if sb is None:
        raise SandboxError(f"no sandbox {params.get('sandbox')!r} registered for a Harbor trial")
    return sb


async def _exec(params: dict[str, Any]) -> dict[str, Any]:
    r = await _sandbox(params).exec(
        params["command"], cwd=params.get("cwd"), env=params.get("env") or None, timeout=params.get("timeout")
    )
    return {"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code}


async def _write(params: dict[str, Any]) -> bool:
    sb, path = _sandbox(params), params["path"]
    await sb.exec(f"mkdir -p {shlex.quote(str(Path(path).parent))}", timeout=30)
    await sb.write_file(path, base64.b64decode(params["data"]))
    return True


async def _read(params: dict[str, Any]) -> str:
    return base64.b64encode(await _sandbox(params).read_file(params["path"])).decode()


async def _list(params: dict[str, Any]) -> list[str]:
    path = shlex.quote(params["path"])
    r = await _sandbox(params).exec(f"cd {path} 2>/dev/null && find . -type f | sed 's|^./||'", timeout=30)
    return [line for line in r.stdout.splitlines() if line]


CALLBACKS = {"sandbox.exec": _exec, "sandbox.write": _write, "sandbox.read": _read, "sandbox.list": _list}


async def run_harbor_trial(
    task_dir: str | Path, agent: str, provider: SandboxProvider, *, trials_dir: str | Path | None = None
) -> dict[str, Any]:
    """One Harbor trial of `task_dir` with Harbor agent `agent`, in a sandbox from `provider`."""
    task_dir = Path(task_dir).resolve()
    task = read_task_dir(task_dir, f"harbor:{task_dir}")
    worker = worker_for("harbor", "harbor_worker.py")
    worker.callbacks.update(CALLBACKS)
    sid = uuid.uuid4().hex
    trials = Path(trials_dir) if trials_dir else Path(tempfile.mkdtemp(prefix="miles-harbor-trials-"))
    sandbox = await provider.create(task.sandbox)
    async with sandbox:
        _SANDBOXES[sid] = sandbox
        try:
            params = {"sandbox": sid, "task_dir": str(task_dir), "agent": agent, "trials_dir": str(trials)}
            return await worker.call("trial", params, timeout=1800)  # type: ignore[no-any-return]
        finally:
            _SANDBOXES.pop(sid, None)
