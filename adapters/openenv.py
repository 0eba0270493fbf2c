"""OpenEnv adapter: an OpenEnv environment server, driven by our agent loop through its reset/step.

Concept: `openenv:TARGET` where TARGET is `http://host:port` (a running env
server) or `module:attr` / `path/file.py:attr` (a FastAPI app from openenv's
`create_app`, served by the worker on loopback). OpenEnv has no agent loop, so
ours drives it: the observation (minus done/reward/metadata) is the user
message, the model's reply fills the action's first string field, until `done`
or `max_turns`. The reward is the sum of the env's own step rewards.

Tasks are seeds: `seed-0` .. `seed-{n-1}` (n = 4 unless `?n=` is appended).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from miles_env.adapters.harness import FRAMEWORK_ROLE, framework_reward, worker_for

from miles_env.environment import Environment, Transcript
from miles_env.harness import Endpoint, HarnessResult
from miles_env.sandbox import Sandbox
from miles_env.types import Reward, Status, Task

__all__ = ["OpenEnvEnvironment", "run_episode", "action_field"]


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


class OpenEnvEnvironment(Environment):
    splits = ("train", "test")

    def __init__(self, target: str, name: str | None = None) -> None:
        target, _, query = target.partition("?n=")
        self.target = target
        self.n = int(query) if query else 4
        self.name = name or f"openenv:{target}"
        self.description = f"OpenEnv environment server {target}"

    def tasks(self, split: str | None = None) -> list[Task]:
        out = []
        for i in range(self.n):
            s = "test" if i % 4 == 3 else "train"
            if split in (None, s):
                out.append(
                    Task(
                        id=f"seed-{i}",
                        env=self.name,
                        instruction=f"OpenEnv episode of {self.target} with seed {i}",
                        split=s,
                        verifier={"seed": i},
                        metadata={"adapter": "openenv", "target": self.target, "seed": i},
                    )
                )
        return out

    async def verify(self, task: Task, sandbox: Sandbox, transcript: Transcript) -> Reward:
        return framework_reward(task, transcript)


async def run_episode(
    task: Task, sandbox: Sandbox, endpoint: Endpoint, *, max_turns: int = 4, max_tokens: int = 64, **_: Any
) -> HarnessResult:
    import openai

    worker = worker_for("openenv", "openenv_worker.py", task.metadata["target"])
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
