"""The Harness contract: an agent loop that acts in a sandbox, and the session recorder it talks to.

A harness gets the task, the sandbox and an Endpoint (a TITO session URL plus
its key). It never sees the engine: every model call goes through the session,
which is where token ids are captured. `SessionRecorder` is what a rollout asks
of the proxy (`miles_env.tito.TitoProxy` implements it): open a session per
episode, hand its Endpoint to the harness, and once the episode is over take the
session's samples and close it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from miles_env.sandbox import Sandbox
from miles_env.types import EpisodeEnd, Status, Task, Trajectory

__all__ = [
    "Endpoint",
    "HarnessResult",
    "Harness",
    "SessionRecorder",
    "SessionRef",
    "SessionState",
    "VerifiesInRun",
]


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
    # How it ended, where the harness knows (an adapter's worker died: ADAPTER_WORKER); None: from
    # `status` (completed, truncated; aborted or failed: HARNESS_CRASH) unless the proxy saw the
    # session's last request fail (miles_env/ends.py)
    end: EpisodeEnd | None = None


class Harness(Protocol):
    name: str

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint) -> HarnessResult: ...


@runtime_checkable
class VerifiesInRun(Protocol):
    """A harness whose `run` also runs the framework's own verifier (an adapter's agent loop, e.g.
    Harbor's Trial): the rollout bounds its run by the task's agent + verifier timeouts."""

    verifies_in_run: bool


class SessionRef(Protocol):
    """A session just opened (tito's SessionHandle)."""

    @property
    def session_id(self) -> str: ...


class SessionState(Protocol):
    """What a rollout reads of a session (tito's SessionInfo)."""

    @property
    def truncated(self) -> str | None: ...  # the budget that cut its last turn, if one did

    @property
    def n_turns(self) -> int: ...

    @property
    def first_prompt(self) -> int | None: ...  # tokens of its first request, answered or refused

    @property
    def fault(self) -> EpisodeEnd | None: ...  # its last request failed, and why (no budget), if it did


@runtime_checkable
class SessionRecorder(Protocol):
    """The proxy as a rollout uses it: one session per episode, recorded as token samples.

    Lifecycle: create_session -> endpoint (for the harness) -> export -> close_session, which
    the rollout always calls, whatever the episode did."""

    def create_session(self, metadata: dict[str, Any] | None = None) -> SessionRef: ...

    def endpoint(self, session_id: str, base_url: str) -> Endpoint:
        """The session's URL and key under the proxy's HTTP root `base_url`."""
        ...

    async def context_limit(self, session_id: str) -> int | None:
        """Prompt + completion tokens the session may use per request, as the proxy enforces it."""
        ...

    def get_session(self, session_id: str) -> SessionState: ...

    def export(self, session_id: str) -> list[Trajectory]:
        """The session's samples: one Trajectory per exported branch."""
        ...

    def close_session(self, session_id: str) -> None: ...
