"""spawn(): a long-running process inside a local sandbox, with its stdin/stdout/stderr as pipes.

Concept: `exec()` runs a command to completion and returns its captured output;
`spawn()` starts the same command line (the sandbox's limits, bwrap namespaces,
mounts, and the expose() bridge's network namespace when there is one) and hands
back the live `anyio.abc.Process`, so the caller can speak a protocol over its
pipes (a framework worker's stdio RPC). Additive: exec() is unchanged.

Invariant: the process is registered in the sandbox's live set, so
`sandbox.close()` kills it (and its whole pid namespace) like any exec; there is
no wall-clock limit here, the caller owns the process's lifetime (`release()`
once it has exited, so a recycled pid is never signalled by close()).

Lifecycle: spawn -> talk over the pipes -> the caller kills or waits for it ->
release(); or simply sandbox.close().
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping

import anyio
from anyio.abc import Process

from miles_env.sandbox import Command

from .sandbox import LocalSandbox

__all__ = ["spawn", "release"]


async def spawn(
    sandbox: LocalSandbox,
    cmd: Command,
    *,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Process:
    """Start `cmd` inside `sandbox` with piped stdin, stdout and stderr; its own process group."""
    sandbox._check_open()
    argv = sandbox._argv(cmd, cwd, env)
    process = await anyio.open_process(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    sandbox._live.add(process.pid)
    return process


def release(sandbox: LocalSandbox, process: Process) -> None:
    """Forget an exited process, so sandbox.close() never signals its (reusable) pid."""
    if process.returncode is not None:
        sandbox._live.discard(process.pid)
