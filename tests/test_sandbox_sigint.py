"""Ctrl-C (SIGINT) on a process that holds a local sandbox: its processes and files are gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import anyio, sys
    from miles_env.sandboxes import get_provider
    from miles_env.types import SandboxSpec

    async def main():
        provider = get_provider("local", root_dir=sys.argv[1])
        async with await provider.create(SandboxSpec()) as sb:
            await sb.write_file("marker.txt", "x")
            print(sb.host_dir, flush=True)
            await sb.exec("sleep 4242", timeout=600)

    anyio.run(main)
    """
)


def _sleepers() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "sleep 4242"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_ctrl_c_kills_the_sandbox_processes_and_removes_its_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    host_dir = Path(proc.stdout.readline().strip())
    assert (host_dir / "work" / "marker.txt").is_file()
    deadline = time.time() + 30
    while not _sleepers() and time.time() < deadline:
        time.sleep(0.05)
    assert _sleepers(), "the command never started in the sandbox"
    os.kill(proc.pid, signal.SIGINT)
    proc.wait(timeout=30)
    assert proc.returncode != 0  # KeyboardInterrupt, after cleanup
    deadline = time.time() + 10
    while _sleepers() and time.time() < deadline:
        time.sleep(0.05)
    assert not _sleepers(), "a sandbox process survived Ctrl-C"
    assert not host_dir.exists(), "the sandbox's files survived Ctrl-C"
