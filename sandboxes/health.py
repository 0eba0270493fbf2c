"""A sidecar's healthcheck (docker compose's `healthcheck.test`), for every provider that runs sidecars.

Concept: compose starts a service a task `depends_on` with `condition: service_healthy` and waits
until its healthcheck passes. `health_argv(test)` turns compose's `test` (["CMD", ...],
["CMD-SHELL", "..."], a string, or ["NONE"]) into the argv to run inside the sidecar;
`wait_healthy()` polls it until it passes, the sidecar exits, or `timeout` passes. The provider
brings the two probes (is it still running; run the check in it), so the docker provider
(sandboxes/docker/sidecars.py) and the local one (sandboxes/local/sidecars.py) wait the same way
and say the same things.

Invariant: without a check the sidecar need only be running; a sidecar that exits while waited on
is an error naming it, with the end of its output.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio

from miles_env.errors import SandboxError

__all__ = ["health_argv", "wait_healthy"]


def health_argv(test: list[str] | str | None) -> list[str] | None:
    """compose healthcheck `test` -> an exec argv (None: no check)."""
    if test is None or test == ["NONE"]:
        return None
    if isinstance(test, str):
        return ["sh", "-c", test]
    if test[:1] == ["CMD"]:
        return list(test[1:])
    if test[:1] == ["CMD-SHELL"]:
        return ["sh", "-c", " ".join(test[1:])]
    return list(test)


async def wait_healthy(
    name: str,
    test: list[str] | str | None,
    *,
    exited: Callable[[], Awaitable[str | None]],
    check: Callable[[list[str]], Awaitable[tuple[bool, str]]],
    timeout: float,
    interval: float = 1.0,
) -> None:
    """Until sidecar `name` passes `test`. `exited()`: None while it runs, else how it ended (its
    status and last output); `check(argv)`: (passed, output) of one run of the check inside it."""
    argv = health_argv(test)
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        why = await exited()
        if why is not None:
            raise SandboxError(f"sidecar {name!r} exited {why}")
        if argv is None:
            return
        passed, last = await check(argv)
        if passed:
            return
        await anyio.sleep(interval)
    raise SandboxError(f"sidecar {name!r}: not healthy after {timeout:g}s (last check: {last[-300:]!r})")
