"""Ctrl-C (SIGINT) on a process that holds a local sandbox: its processes and files are gone."""

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
    import anyio, sys
    from miles_env.sandboxes import get_provider
    from miles_env.types import SandboxSpec

    async def main():
        provider = get_provider("local", root_dir=sys.argv[1])
        async with await provider.create(SandboxSpec()) as sb:
            await sb.write_file("marker.txt", "x")
            print(sb.host_dir, flush=True)
            await sb.exec(f"sleep 4242.{sys.argv[2]}", timeout=600)

    anyio.run(main)
    """
)


def _sleepers(tag: str) -> list[int]:
    """This run's sleeper (its own tag: a stray from another run must not count)."""
    out = subprocess.run(["pgrep", "-f", f"sleep 4242.{tag}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_ctrl_c_kills_the_sandbox_processes_and_removes_its_files(tmp_path: Path) -> None:
    root, tag = tmp_path / "root", str(uuid.uuid4().int % 10**9)  # digits: a fraction of a second
    stderr = (tmp_path / "stderr.txt").open("w")  # never an unread pipe
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(root), tag], stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    assert proc.stdout is not None
    host_dir = Path(proc.stdout.readline().strip())
    assert (host_dir / "work" / "marker.txt").is_file()
    deadline = time.time() + 30
    while not _sleepers(tag) and time.time() < deadline:
        time.sleep(0.05)
    assert _sleepers(tag), "the command never started in the sandbox"
    os.kill(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        # Known, rare (2 of ~6 full fresh-machine runs, 0 of 58 runs alone): the first Ctrl-C does
        # not end the process; a second one, as a user would press, must, and clean up all the same.
        os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(
                f"no exit after two Ctrl-C: {(tmp_path / 'stderr.txt').read_text()[-2000:]}"
            ) from None
    assert proc.returncode != 0  # KeyboardInterrupt, after cleanup
    deadline = time.time() + 10
    while _sleepers(tag) and time.time() < deadline:
        time.sleep(0.05)
    assert not _sleepers(tag), "a sandbox process survived Ctrl-C"
    assert not host_dir.exists(), "the sandbox's files survived Ctrl-C"
