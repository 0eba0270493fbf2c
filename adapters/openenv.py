"""OpenEnv adapter: an OpenEnv environment server, driven by our agent loop through its reset/step.

Concept: `openenv:TARGET` where TARGET is `http://host:port` (a running env
server) or `module:attr` / `path/file.py:attr` (a FastAPI app from openenv's
`create_app`, served by the worker on loopback). OpenEnv has no agent loop, so
ours drives it: the observation (minus done/reward/metadata) is the user
message, the model's reply fills the action's first string field, until `done`
or `max_turns`. The reward is the sum of the env's own step rewards.

Tasks are seeds: `seed-0` .. `seed-{n-1}` (n = 4 unless `?n=` is appended).

A `path/file.py:attr` target is served as openenv's own server would serve it: from
its project root (the nearest folder at or above the file, up to 3 levels, holding
`openenv.yaml`, as `openenv init` lays it out; else the file's folder), that root
mounted and first on sys.path, the file imported by its dotted name (`server.app`),
so `from models import ...` and `from server.x import ...` resolve.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from miles_env.adapters.framework_harness import FRAMEWORK_ROLE
from miles_env.adapters.worker_client import WorkerClient
from miles_env.adapters.worker_env import WorkerEnvironment
from miles_env.harness import Endpoint, HarnessResult
from miles_env.types import Status, Task

__all__ = ["OpenEnvEnvironment", "action_field", "project_root"]

_ROOT_MARKER, _ROOT_LEVELS = "openenv.yaml", 3  # the worker applies the same rule (openenv_worker.py)


def project_root(file: Path) -> Path:
    """The folder openenv serves `file` from: the nearest ancestor with openenv.yaml, else its folder."""
    for folder in list(file.parents)[:_ROOT_LEVELS]:
        if (folder / _ROOT_MARKER).is_file():
            return folder
    return file.parent


def action_field(schema: dict[str, Any]) -> str:
    """The first string property of the action schema (other than metadata)."""
    props = (schema.get("action") or {}).get("properties", {})
    for name, prop in props.items():
        if name != "metadata" and prop.get("type") == "string":
            return str(name)
    raise ValueError(f"OpenEnv action schema has no string field: {sorted(props)}")


def _observation_text(obs: dict[str, Any]) -> str:
    shown = {k: v for k, v in obs.items() if k not in ("done", "reward", "metadata")}
    if len(shown) == 1:
        return str(next(iter(shown.values())))
    return json.dumps(shown)


class OpenEnvEnvironment(WorkerEnvironment):
    """Tasks are seeds, listed without a worker; our agent loop drives the env's reset/step."""

    adapter, script = "openenv", "openenv_worker.py"
    splits = ("train", "test")

    def __init__(self, target: str, name: str | None = None) -> None:
        target, _, query = target.partition("?n=")
        file, sep, attr = target.rpartition(":")
        if sep and file.endswith(".py"):  # absolute: the worker's cwd is the sandbox's workspace
            target = f"{Path(file).expanduser().resolve()}:{attr}"
        self.target = target
        self.n = int(query) if query else 4
        super().__init__(name or f"openenv:{target}", f"OpenEnv environment server {target}", (target,))

    def make_task(self, row: dict[str, Any]) -> Task:
        seed = int(row["seed"])
        return Task(
            id=f"seed-{seed}",
            env=self.name,
            instruction=f"OpenEnv episode of {self.target} with seed {seed}",
            split="test" if seed % 4 == 3 else "train",
            verifier={"seed": seed},
            metadata={"adapter": "openenv", "target": self.target, "seed": seed},
        )

    def tasks(self, split: str | None = None) -> list[Task]:
        seeds = [self.make_task({"seed": i}) for i in range(self.n)]
        return [t for t in seeds if split in (None, t.split)]

    @classmethod
    def episode_args(cls, task: Task) -> tuple[str, ...]:
        return (task.metadata["target"],)

    @classmethod
    def mounts(cls, args: tuple[str, ...]) -> list[str]:
        file, sep, _ = args[0].rpartition(":")
        return [str(project_root(Path(file)))] if sep and file.endswith(".py") else []

    @classmethod
    async def drive(
        cls,
        worker: WorkerClient,
        task: Task,
        endpoint: Endpoint,
        base_url: str,
        *,
        max_turns: int = 4,
        max_tokens: int = 64,
        **config: Any,
    ) -> HarnessResult:
        # Our loop runs on the host, so it calls the model at the endpoint's own URL, not `base_url`.
        return await _drive(worker, task, endpoint, max_turns, max_tokens)


async def _drive(
    worker: WorkerClient, task: Task, endpoint: Endpoint, max_turns: int, max_tokens: int
) -> HarnessResult:
    """Our agent loop over the env's reset/step; the model is called from the host."""
    import openai

    info = await worker.call("info", timeout=120)
    field = action_field(info["schema"])
    session = uuid.uuid4().hex
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages: list[dict[str, Any]] = []
    total, done, steps = 0.0, False, 0
    try:
        r = await worker.call(
            "reset", {"session": session, "kwargs": {"seed": task.metadata["seed"]}}, timeout=60
        )
        messages.append({"role": "user", "content": _observation_text(r["observation"])})
        while not r["done"] and steps < max_turns:
            resp = await client.chat.completions.create(
                model=endpoint.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
            )
            text = resp.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            r = await worker.call("step", {"session": session, "action": {field: text}}, timeout=60)
            steps += 1
            total += float(r["reward"] or 0.0)
            done = bool(r["done"])
            messages.append({"role": "user", "content": _observation_text(r["observation"])})
    finally:
        await client.close()
        try:
            await worker.call("close", {"session": session}, timeout=10)
        except Exception:  # the episode's result stands even if the client close fails
            pass
    details = {"steps": steps, "done": done, "action_field": field, "server": info["url"]}
    messages.append({"role": FRAMEWORK_ROLE, "reward": total, "details": details})
    return HarnessResult(Status.COMPLETED if done else Status.TRUNCATED, messages, None, details)
