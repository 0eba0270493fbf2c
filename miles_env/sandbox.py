"""The Sandbox and SandboxProvider contracts.

A sandbox is an isolated place where one episode's commands run. Lifecycle:
`provider.create(spec)` -> use -> `close()`. `close()` is idempotent and is
guaranteed by `async with`, also on cancellation. Providers live in
`miles_env.sandboxes.<name>`; core never imports them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from miles_env.types import ExecResult, SandboxSpec

__all__ = ["Sandbox", "SandboxProvider", "Command"]

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
    ) -> ExecResult: ...

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
