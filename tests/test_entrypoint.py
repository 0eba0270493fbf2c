"""start_entrypoint()'s starter script (sandboxes/entrypoint.py), run on the host through a stand-in sandbox.

The starter is plain sh over /proc, so the host runs it as a sandbox would; what a loaded machine
does to it is reproduced with a shim on PATH: `tr` (which reads the entrypoint's cmdline) coming back
empty once, as a read inside execve does (the kernel shows an empty cmdline between the new memory
map and the new arguments; a starter polling 40 entrypoints at once on 2 busy cores read one in 5 of
200 starts), or taking 0.4 s, as a fork under load does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from miles_env.errors import SandboxError
from miles_env.sandboxes.entrypoint import start_entrypoint
from miles_env.types import ExecResult

pytestmark = pytest.mark.anyio

# The first read of a cmdline comes back empty; later ones are the real `tr`.
_EMPTY_ONCE = """#!/bin/sh
if [ ! -e "$0.once" ]; then : > "$0.once"; cat >/dev/null; exit 0; fi
exec /usr/bin/tr "$@"
"""
_SLOW = """#!/bin/sh
/bin/sleep 0.4
exec /usr/bin/tr "$@"
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class HostSandbox:
    """Runs an exec's argv on the host in its own process group, all of which close() ends."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.groups: list[int] = []

    async def exec(self, cmd: Sequence[str], *, timeout: float | None = None, **_: object) -> ExecResult:
        def run() -> ExecResult:
            t0 = time.monotonic()
            p = subprocess.Popen(
                list(cmd), env={**os.environ, "PATH": self.path}, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
            self.groups.append(p.pid)
            try:
                out, err = p.communicate(timeout=timeout)
                code, timed_out = p.returncode, False
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, err = p.communicate()
                code, timed_out = -9, True
            took = time.monotonic() - t0
            return ExecResult(code, out.decode(), err.decode(), timed_out=timed_out, duration_s=took)

        return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)

    def close(self) -> None:
        for g in self.groups:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def host(tmp_path: Path):
    def make(tr: str | None = None) -> HostSandbox:
        path = os.environ["PATH"]
        if tr is not None:
            (tmp_path / "tr").write_text(tr)
            (tmp_path / "tr").chmod(0o755)
            path = f"{tmp_path}:{path}"
        sandboxes.append(HostSandbox(path))
        return sandboxes[-1]

    sandboxes: list[HostSandbox] = []
    yield make
    for sb in sandboxes:
        sb.close()


EXECS_ITS_COMMAND = ["/bin/sh", "-c", 'echo up; exec "$@"', "entrypoint"]


async def test_ready_once_it_runs_its_command(host):
    assert await start_entrypoint(host(), EXECS_ITS_COMMAND, ready_s=10) == "ready"


async def test_an_empty_cmdline_from_a_live_process_is_not_its_end(host):
    """The cause of `exit -9: Killed` under load: the starter read the cmdline inside execve, took
    it for an ended process and `wait`ed on it (now `sleep infinity`) until the exec timed out."""
    with anyio.fail_after(15):
        assert await start_entrypoint(host(tr=_EMPTY_ONCE), EXECS_ITS_COMMAND, ready_s=10) == "ready"


async def test_the_wait_is_wall_time_not_a_count_of_polls(host):
    """An entrypoint still busy after ready_s is left running: after ready_s of wall time, however
    slow each poll is (10 x ready_s polls of 0.5 s each took 5 x longer)."""
    t0 = time.monotonic()
    busy = ["/bin/sh", "-c", "sleep 30", "busy"]  # never runs its command
    assert await start_entrypoint(host(tr=_SLOW), busy, ready_s=1) == "waiting"
    assert time.monotonic() - t0 < 2.5


async def test_an_entrypoint_that_ends(host):
    assert await start_entrypoint(host(), ["/bin/sh", "-c", "echo set up", "setup"], ready_s=10) == "exited 0"
    with pytest.raises(SandboxError, match=r"exited 3 before running its command: .*broken"):
        await start_entrypoint(host(), ["/bin/sh", "-c", "sleep 0.3; echo broken; exit 3", "bad"], ready_s=10)
