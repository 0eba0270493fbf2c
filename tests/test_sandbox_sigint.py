"""Ctrl-C (SIGINT) on a process that holds a local sandbox: one Ctrl-C ends it, and its processes and
files are gone, its compose sidecar's too.

Why the child resets SIGINT first: a user's Ctrl-C reaches a foreground job, whose SIGINT is Python's
KeyboardInterrupt handler. A process started from a background job of a non-interactive shell (how
CI runners and `cmd &` start pytest) inherits SIGINT *ignored*; Python then installs no handler, and
asyncio's runner installs its Ctrl-C handling only over Python's own. The child of such a pytest
ignored every Ctrl-C: the test failed with "no exit after two Ctrl-C" and an empty stderr in some
fresh-machine runs and never in an agent's shell. That was the test's environment, not the sandbox;
the child now starts as a terminal's foreground job would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a foreground job has it (see above)
    import anyio, sys
    from miles_env.sandboxes import get_provider
    from miles_env.sandboxes.local.sidecars import WORKDIR, Sidecar
    from miles_env.types import SandboxSpec

    async def main():
        provider = get_provider("local", root_dir=sys.argv[1])
        async with await provider.create(SandboxSpec()) as sb:
            await sb.write_file("marker.txt", "x")
            await sb.exec(f"sleep 4243.{sys.argv[2]} > /dev/null 2>&1 &")  # a process left running
            # A compose sidecar beside it, as start_sidecar makes one (the host's view: no image to build).
            side = await provider._sidecar(SandboxSpec(workdir=WORKDIR), sb._zygote)
            sb._sidecars.append(Sidecar.start("side", side, ["sleep", f"4244.{sys.argv[2]}"]))
            print(sb.host_dir, side.host_dir, flush=True)
            await sb.exec(f"sleep 4242.{sys.argv[2]}", timeout=600)

    anyio.run(main)
    """
)


def _sleepers(tag: str) -> list[int]:
    """This run's sleepers (its own tag: a stray from another run must not count)."""
    out = subprocess.run(["pgrep", "-f", f"sleep 424[234].{tag}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_one_ctrl_c_kills_the_sandbox_processes_and_removes_its_files(tmp_path: Path) -> None:
    root, tag = tmp_path / "root", str(uuid.uuid4().int % 10**9)  # digits: a fraction of a second
    stderr = (tmp_path / "stderr.txt").open("w")  # never an unread pipe
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(root), tag], stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    assert proc.stdout is not None
    host_dir, sidecar_dir = map(Path, proc.stdout.readline().split())
    assert (host_dir / "work" / "marker.txt").is_file() and sidecar_dir.is_dir()
    deadline = time.time() + 30
    while len(_sleepers(tag)) < 3 and time.time() < deadline:
        time.sleep(0.05)
    assert len(_sleepers(tag)) >= 3, "the commands never started in the sandbox and its sidecar"
    os.kill(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(
            f"no exit 30 s after one Ctrl-C: {(tmp_path / 'stderr.txt').read_text()[-2000:]}"
        ) from None
    assert proc.returncode != 0  # KeyboardInterrupt, after cleanup
    deadline = time.time() + 10
    while _sleepers(tag) and time.time() < deadline:
        time.sleep(0.05)
    assert not _sleepers(tag), "a sandbox process survived Ctrl-C"
    assert not host_dir.exists(), "the sandbox's files survived Ctrl-C"
    assert not sidecar_dir.exists(), "its sidecar's files survived Ctrl-C"
