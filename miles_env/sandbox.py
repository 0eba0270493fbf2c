"""The Sandbox and SandboxProvider contracts.

A sandbox is an isolated place where one episode's commands run. Lifecycle:
`provider.create(spec)` -> use -> `close()`. `close()` is idempotent and is
guaranteed by `async with`, also on cancellation. Providers live in
`miles_env.sandboxes.<name>`; core never imports them.

Optional provider capabilities are Protocols checked with isinstance, never
probed by attribute name: `Reapable` (removes what crashed runs left behind, by
ownership labels) and `AsyncClosable` (holds resources beyond its sandboxes, e.g.
the local provider's idle zygotes, released by `aclose()`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from miles_env.types import ExecResult, SandboxSpec

__all__ = ["Sandbox", "SandboxProvider", "Command", "Reapable", "AsyncClosable"]

# A shell string (run with `sh -c`) or an argv list (run as is).
Command = str | Sequence[str]


@runtime_checkable
class Sandbox(Protocol):
    id: str
    workdir: str

    async def exec(
        self,
        cmd: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        user: str | None = None,
    ) -> ExecResult:
        """Run `cmd`. `user`: who runs it, as `docker exec -u` takes it (`name`, `uid`, `name:group`,
        `uid:gid`), looked up in the image's /etc/passwd and /etc/group; None: the sandbox's own
        user (the image's USER). A provider that cannot run an exec as another user raises
        SandboxError for a `user`, never runs it as someone else."""
        ...

    async def write_file(self, path: str, data: bytes | str) -> None: ...

    async def read_file(self, path: str) -> bytes: ...

    async def expose(self, url: str) -> str:
        """Make a host HTTP endpoint reachable from inside; return the URL to use inside."""
        ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, *exc: object) -> None: ...


@runtime_checkable
class SandboxProvider(Protocol):
    name: str

    async def create(self, spec: SandboxSpec) -> Sandbox: ...


@runtime_checkable
class Reapable(Protocol):
    """A provider that can find and remove the sandboxes crashed runs left behind."""

    async def reap(self, ttl_s: float | None = None) -> list[str]:
        """Remove stale sandboxes (dead owner, or older than `ttl_s`); return their ids."""
        ...


@runtime_checkable
class AsyncClosable(Protocol):
    """A provider holding resources of its own (not its sandboxes'), released by `aclose()`."""

    async def aclose(self) -> None: ...


@runtime_checkable
class RunsSidecars(Protocol):
    """A sandbox that runs helper containers beside it (a Harbor task's docker-compose services):
    each in the sandbox's network namespace, its name resolving there, removed when the sandbox
    closes. `build` is a build context directory; `healthcheck` compose's `test` form; the call
    returns once the sidecar is healthy (or running, without a healthcheck)."""

    async def start_sidecar(
        self,
        name: str,
        *,
        image: str | None = None,
        build: str | None = None,
        dockerfile: str | None = None,
        env: Mapping[str, str] | None = None,
        command: list[str] | str | None = None,
        healthcheck: list[str] | str | None = None,
        timeout: float = 120.0,
    ) -> None: ...
