"""Harbor's own Trial on our sandbox: the harbor package (its venv) drives, our sandbox executes.

Concept: `run_harbor_trial(task_dir, agent, provider)` (environment.py) creates and sets up one of
our sandboxes for the task (the same spec and Dockerfile setup as a native episode) and `trial_in_sandbox` asks the
harbor worker to run `Trial.create(TrialConfig(environment.import_path=
"harbor_env:MilesSandboxEnvironment"))` in it. That environment class calls back into
this process (`sandbox.exec/keep/write/read/list`) for every command and file
transfer, so Harbor's agent and verifier run in our sandbox. The reward is Harbor's
own `verifier_result.rewards`. `run_episode` (the `framework` harness on a
`harbor:` task) does the same in the episode's sandbox with an LLM agent
(`terminus-2` by default) whose model endpoint is the episode's TITO session, so
every model token is captured by our proxy.

Invariant: callbacks reach only the sandbox registered for the running trial;
keeper execs (a tmux server's namespace) are cancelled when the trial returns; the
sandbox is closed by whoever created it.
"""

from __future__ import annotations

import asyncio
import base64
import shlex
import tempfile
import uuid
from pathlib import Path
from typing import Any

import anyio

from miles_env.adapters.framework_harness import FRAMEWORK_ROLE
from miles_env.adapters.worker_pool import worker_for
from miles_env.errors import SandboxError
from miles_env.harness import Endpoint, HarnessResult
from miles_env.sandbox import Sandbox
from miles_env.types import Status, Task

__all__ = ["trial_in_sandbox", "run_episode"]

_SANDBOXES: dict[str, Sandbox] = {}
_KEEPERS: dict[str, list[asyncio.Task[Any]]] = {}
_KEEP_S = 6 * 3600.0  # a keeper's exec limit; it ends with the trial anyway


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


async def _keep(params: dict[str, Any]) -> dict[str, Any]:
    """Run `command` in an exec that then stays alive while `alive` succeeds (a tmux server).

    The exit code lands in `<tag>.rc` by rename, so a poll never reads it half-written.
    """
    sb, sid = _sandbox(params), str(params["sandbox"])
    tag = f"/tmp/.miles-keep-{uuid.uuid4().hex[:12]}"
    alive = params.get("alive") or "false"
    script = (
        f"{{ {params['command']}\n}} >{tag}.out 2>{tag}.err </dev/null; echo $? >{tag}.tmp; mv {tag}.tmp {tag}.rc\n"
        f"while {alive} >/dev/null 2>&1; do sleep 0.5; done"
    )
    keeper = asyncio.get_running_loop().create_task(
        sb.exec(["bash", "-c", script], cwd=params.get("cwd"), env=params.get("env") or None, timeout=_KEEP_S)
    )
    _KEEPERS.setdefault(sid, []).append(keeper)
    deadline = asyncio.get_running_loop().time() + float(params.get("timeout") or 60)
    while asyncio.get_running_loop().time() < deadline:
        r = await sb.exec(
            f"test -f {tag}.rc || exit 3; cat {tag}.rc {tag}.out; echo; echo @@; cat {tag}.err", timeout=30
        )
        if r.exit_code == 0:
            code, _, rest = r.stdout.partition("\n")
            out, _, err = rest.partition("\n@@\n")
            return {"stdout": out.removesuffix("\n"), "stderr": err, "exit_code": int(code)}
        if keeper.done():
            res = keeper.result()
            return {"stdout": res.stdout, "stderr": res.stderr, "exit_code": res.exit_code or 1}
        await asyncio.sleep(0.1)
    return {
        "stdout": "",
        "stderr": f"keeper command did not finish: {params['command'][:200]}",
        "exit_code": 124,
    }


async def _write(params: dict[str, Any]) -> bool:
    sb, path = _sandbox(params), params["path"]
    await sb.exec(f"mkdir -p {shlex.quote(str(Path(path).parent))}", timeout=30)
    await sb.write_file(path, base64.b64decode(params["data"]))
    if params.get("mode") is not None:  # the source file's permission bits (an executable stays one)
        res = await sb.exec(f"chmod {int(params['mode']):o} {shlex.quote(path)}", timeout=30)
        if not res.ok:
            raise SandboxError(f"chmod {path}: {res.stderr.strip()[-300:]}")
    return True


async def _read(params: dict[str, Any]) -> str:
    return base64.b64encode(await _sandbox(params).read_file(params["path"])).decode()


async def _list(params: dict[str, Any]) -> list[str]:
    path = shlex.quote(params["path"])
    r = await _sandbox(params).exec(f"cd {path} 2>/dev/null && find . -type f | sed 's|^./||'", timeout=30)
    return [line for line in r.stdout.splitlines() if line]


CALLBACKS = {
    "sandbox.exec": _exec,
    "sandbox.keep": _keep,
    "sandbox.write": _write,
    "sandbox.read": _read,
    "sandbox.list": _list,
}


async def trial_in_sandbox(
    sandbox: Sandbox,
    task_dir: str | Path,
    agent: str,
    *,
    model: dict[str, str] | None = None,
    agent_kwargs: dict[str, Any] | None = None,
    trials_dir: str | Path | None = None,
    agent_timeout_s: float | None = None,
    timeout: float = 1800.0,
) -> dict[str, Any]:
    """One Harbor trial in an open sandbox; `model` = {base_url, api_key, model} for LLM agents.

    Harbor's own record (trial dir with result.json, agent logs) is kept under `trials_dir`;
    without one it goes to a temporary directory removed afterwards (`trial_uri` None).
    """
    worker = worker_for("harbor", "harbor_worker.py")
    worker.callbacks.update(CALLBACKS)
    sid = uuid.uuid4().hex
    scratch = None if trials_dir else tempfile.TemporaryDirectory(prefix="miles-harbor-trials-")
    trials = Path(trials_dir) if trials_dir else Path(scratch.name)  # type: ignore[union-attr]
    _SANDBOXES[sid] = sandbox
    params: dict[str, Any] = {
        "sandbox": sid,
        "task_dir": str(Path(task_dir).resolve()),
        "agent": agent,
        "trials_dir": str(trials),
        "model": model,
        "agent_kwargs": agent_kwargs or {},
        "agent_timeout_s": agent_timeout_s,
    }
    try:
        result: dict[str, Any] = await worker.call("trial", params, timeout=timeout)
        if scratch is not None:
            result["trial_uri"] = None
        return result
    finally:
        _SANDBOXES.pop(sid, None)
        keepers = _KEEPERS.pop(sid, [])
        if keepers:
            with anyio.CancelScope(shield=True), anyio.move_on_after(15):
                await _stop_keepers(sandbox, keepers)
        if scratch is not None:
            scratch.cleanup()


async def _stop_keepers(sandbox: Sandbox, keepers: list[asyncio.Task[Any]]) -> None:
    try:
        await sandbox.exec("tmux kill-server >/dev/null 2>&1; true", timeout=30)
    except Exception:  # the sandbox may already be gone; the keepers die with it
        pass
    for k in keepers:
        k.cancel()
    await asyncio.gather(*keepers, return_exceptions=True)


async def run_episode(
    task: Task,
    sandbox: Sandbox,
    endpoint: Endpoint,
    *,
    agent: str = "terminus-2",
    max_turns: int | None = None,
    temperature: float | None = None,
    max_tokens: int | None = None,
    agent_timeout_s: float | None = None,
    trials_dir: str | None = None,
    isolation: object = None,
    **agent_kwargs: Any,
) -> HarnessResult:
    """The `framework` harness on a Harbor task: Harbor's agent on the TITO session, Harbor's verifier.

    `isolation` is accepted and not needed: every command of Harbor's agent and
    verifier already runs in the episode's sandbox; the host worker only orchestrates
    (Harbor's trusted package code) and calls the model.
    """
    if max_turns is not None:
        agent_kwargs.setdefault("max_turns", max_turns)
    if temperature is not None:
        agent_kwargs.setdefault("temperature", temperature)
    if max_tokens is not None:  # per model call; TITO's default applies otherwise
        agent_kwargs["llm_call_kwargs"] = {
            **agent_kwargs.get("llm_call_kwargs", {}),
            "max_tokens": int(max_tokens),
        }
    agent_s = (
        float(agent_timeout_s) if agent_timeout_s is not None else float(task.sandbox.resources.timeout_s)
    )
    model = {"base_url": endpoint.base_url, "api_key": endpoint.api_key, "model": endpoint.model}
    r = await trial_in_sandbox(
        sandbox,
        task.verifier["task_dir"],
        agent,
        model=model,
        agent_kwargs=agent_kwargs,
        trials_dir=trials_dir,
        agent_timeout_s=agent_s,
        timeout=agent_s + float(task.verifier.get("timeout_s", 600.0)) + 300,
    )
    rewards = r.get("rewards")
    details = {
        "rewards": rewards,
        "exception": r.get("exception"),
        "trial_uri": r.get("trial_uri"),
        "agent": agent,
    }
    score = _score(rewards)
    transcript: list[dict[str, Any]] = [{"role": "user", "content": task.instruction}]
    transcript.append({"role": FRAMEWORK_ROLE, "reward": score, "details": details})
    if rewards is None:
        return HarnessResult(
            Status.FAILED, transcript, f"harbor trial: no verifier result: {r.get('exception')}", details
        )
    if r.get("exception_type") == "AgentTimeoutError":  # Harbor still verified what the agent left
        return HarnessResult(
            Status.TRUNCATED, transcript, f"harbor agent timed out after {agent_s}s", details
        )
    return HarnessResult(Status.COMPLETED, transcript, None, details)


def _score(rewards: dict[str, Any] | None) -> float:
    if not rewards:
        return 0.0
    nums = {k: float(v) for k, v in rewards.items() if isinstance(v, (int, float))}
    return nums["reward"] if "reward" in nums else (sum(nums.values()) / len(nums) if nums else 0.0)
