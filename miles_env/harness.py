"""The Harness contract: an agent loop that acts in a sandbox.

A harness gets the task, the sandbox and an Endpoint (a TITO session URL plus
its key). It never sees the engine: every model call goes through the session,
which is where token ids are captured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from miles_env.sandbox import Sandbox
from miles_env.types import Status, Task

__all__ = ["Endpoint", "HarnessResult", "Harness"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    base_url: str  # e.g. http://127.0.0.1:PORT/s/<session>/v1 (OpenAI style base URL)
    api_key: str
    session_id: str
    model: str = "policy"
    root_url: str = ""  # session root without /v1 (Anthropic-style clients append /v1 themselves)
    # The session's context limit (prompt + completion tokens) as the proxy enforces it, when known:
    # harnesses tell their CLI, so that it compacts before (or when) a request would not fit.
    max_context: int | None = None


@dataclass(frozen=True, slots=True)
class HarnessResult:
    status: Status
    transcript: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


class Harness(Protocol):
    name: str

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint) -> HarnessResult: ...
