"""HUD worker: runs HUD template tasks on the local runtime with HUD's OpenAIChatAgent.

Usage: python hud_worker.py ENV_FILE. ENV_FILE declares an `hud.Environment` with
`@env.template` tasks and a `hud.eval.Taskset` (or a list of Task rows) at module
level. Each `run` drives `hud.eval.rollout(task, OpenAIChatAgent, runtime=LocalRuntime(ENV_FILE))`
with the agent's base URL set to the episode's TITO session; the reward is HUD's
own grade (`run.reward`, what the template yields after the answer).

Tasks are looked for where HUD's own tools look, in order: the globals of ENV_FILE
(a Taskset, a Task, a list or tuple of Tasks); else task files beside it
(`tasks*.json` / `tasks*.jsonl`, `hud eval`'s format, read by `Taskset.from_file`);
else every module of its folder (`Taskset.from_module`, so a `tasks.py` that imports
the env and declares the rows is found). None anywhere is an error saying where it looked.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

from _rpc import serve

ENV_FILE = str(Path(sys.argv[1]).resolve())
os.environ.setdefault("HUD_TELEMETRY_ENABLED", "false")
_state: dict[str, Any] = {}


def _scan(module: Any) -> list[Any]:
    from hud.eval import Task, Taskset

    rows: list[Any] = []
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if isinstance(value, Taskset):
            ts = value.tasks
            rows += list(ts.values()) if isinstance(ts, dict) else list(ts)
        elif isinstance(value, Task):
            rows.append(value)
        elif isinstance(value, list | tuple) and value and all(isinstance(v, Task) for v in value):
            rows += value
    return rows


def _elsewhere(folder: Path) -> list[Any]:
    """Task files beside the env file, else every module of its folder (HUD's own loaders)."""
    from hud.eval import Taskset

    files = sorted([*folder.glob("tasks*.json"), *folder.glob("tasks*.jsonl")])
    if files:
        return [t for f in files for t in Taskset.from_file(f)]
    return list(Taskset.from_module(folder))


def _rows() -> list[Any]:
    if "rows" in _state:
        return _state["rows"]  # type: ignore[no-any-return]
    folder = Path(ENV_FILE).parent
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(Path(ENV_FILE).stem, ENV_FILE)
    assert spec is not None and spec.loader is not None, f"cannot import {ENV_FILE}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rows = _scan(module) or _elsewhere(folder)
    if not rows:
        raise RuntimeError(
            f"no HUD tasks found: none in {Path(ENV_FILE).name}'s globals, no tasks*.json(l) and no module "
            f"declaring Tasks in {folder}; declare a Taskset (or a list of Tasks) in one of them"
        )
    _state["rows"] = rows
    return rows


async def tasks(params: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"idx": i, "id": r.slug, "template": r.id, "args": r.args} for i, r in enumerate(_rows())]


async def run(params: dict[str, Any]) -> dict[str, Any]:
    from hud.agents.openai_compatible.agent import OpenAIChatAgent
    from hud.agents.types import OpenAIChatConfig
    from hud.eval import LocalRuntime, rollout

    row = _rows()[params["idx"]]
    agent = OpenAIChatAgent(
        OpenAIChatConfig(model=params["model"], base_url=params["base_url"], api_key=params["api_key"])
    )
    r = await rollout(row, agent, runtime=LocalRuntime(ENV_FILE), rollout_timeout=params.get("timeout"))
    trace = getattr(r, "trace", None)
    return {
        "reward": float(r.reward),
        "error": str(getattr(r, "error", None) or getattr(trace, "error", None) or "") or None,
        "answer": str(getattr(trace, "content", "") or ""),
    }


if __name__ == "__main__":
    t0 = time.perf_counter()
    import hud

    serve(
        {"tasks": tasks, "run": run},
        {
            "framework": "hud",
            "version": getattr(hud, "__version__", "?"),
            "import_s": time.perf_counter() - t0,
        },
    )
