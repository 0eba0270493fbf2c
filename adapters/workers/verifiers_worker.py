"""Verifiers worker: runs verifiers.v1 episodes (the framework's own agent loop and rubric).

Usage: python verifiers_worker.py TASKSET_ID [PATH...]. TASKSET_ID names an installed
taskset (or a module on PATH) exporting a `Taskset` subclass. The agent runs the
`null` harness (verifiers' chat program) in a subprocess runtime; its model client is
pointed at the base URL each `run` call gives (a TITO session). Offline: verifiers
would `uv sync` the chat program's script environment (network); here the script
runs with this venv's interpreter, which already has its dependencies (openai, mcp).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

from _rpc import serve

TASKSET = sys.argv[1]
sys.path[:0] = sys.argv[2:]
_state: dict[str, Any] = {}


def _offline_uv_scripts() -> None:
    from verifiers.v1.runtimes.base import Runtime

    async def prepare_uv_script(
        self: Any, script: Any, env: Any = None, *, activate: bool = True
    ) -> list[str]:
        import hashlib

        data = script.encode() if isinstance(script, str) else script
        path = f"{self.scripts_dir}/{hashlib.sha256(data).hexdigest()}.py"
        await self.write(path, data)
        return [sys.executable, path]

    Runtime.prepare_uv_script = prepare_uv_script  # type: ignore[method-assign]


async def _env() -> Any:
    if "env" in _state:
        return _state["env"]
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.envs.single_agent import SingleAgentEnvConfig
    from verifiers.v1.runtimes.subprocess import SubprocessConfig
    from verifiers.v1.utils.loaders import load_environment

    _offline_uv_scripts()
    cfg = SingleAgentEnvConfig(
        taskset=TasksetConfig(id=TASKSET),
        agent=AgentConfig(harness={"id": "null"}, runtime=SubprocessConfig()),
    )
    env = load_environment(cfg)
    stack = contextlib.AsyncExitStack()
    await stack.enter_async_context(env.serving())
    _state.update(env=env, stack=stack, tasks=list(env.taskset))
    return env


async def tasks(params: dict[str, Any]) -> list[dict[str, Any]]:
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.utils.loaders import load_taskset

    ts = load_taskset(TasksetConfig(id=TASKSET))
    return [
        {"idx": i, "id": t.data.id or t.data.name or f"task-{i}", "prompt": t.data.prompt_text, "key": t.key}
        for i, t in enumerate(ts)
    ]


async def run(params: dict[str, Any]) -> dict[str, Any]:
    import verifiers.v1 as vf

    env = await _env()
    task = _state["tasks"][params["idx"]]
    var = f"MILES_ENV_KEY_{params['session']}"
    os.environ[var] = params["api_key"]
    try:
        client = vf.EvalClientConfig(base_url=params["base_url"], api_key_var=var)
        ctx = vf.ModelContext(model=params["model"], client=client)
        ep = await env.run_episode(task, ctx)
    finally:
        os.environ.pop(var, None)
    traces = list(ep.traces)
    return {
        "reward": traces[0].reward if traces else 0.0,
        "rewards": {k: (v.score if v is not None else None) for k, v in traces[0].rewards.items()}
        if traces
        else {},
        "ok": bool(ep.ok),
        "errors": [str(e) for e in ep.errors],
        "trace_errors": [str(e) for t in traces for e in t.errors],
        "reply": traces[0].last_reply if traces else "",
        **({"trace": traces[0].model_dump(mode="json")} if params.get("keep_trace") and traces else {}),
    }


if __name__ == "__main__":
    t0 = time.perf_counter()
    import verifiers

    serve(
        {"tasks": tasks, "run": run},
        {"framework": "verifiers", "version": verifiers.__version__, "import_s": time.perf_counter() - t0},
    )
