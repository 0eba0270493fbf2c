"""ManagedServer's leash: a launched server's whole process group dies with the run that launched it.

The server here is a stand-in (a stdlib HTTP server that forks a grandchild, as vLLM forks its
engine core); the launching run is a child process we SIGKILL, as an OOM killer or a preempted node
would. Without the leash both server processes were left running (seen with real vLLM servers).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from miles_env.engines._launch import ManagedServer, ServerSpec

SERVER = """
import http.server, os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("PIDS", os.getpid(), child.pid, flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
"""
RUN = """
import anyio, json, sys
from pathlib import Path
from miles_env.engines._launch import ManagedServer, ServerSpec
spec = ServerSpec("stand-in", tuple(json.loads(sys.argv[1])), sys.argv[2], Path(sys.argv[3]), health_path="/")
server = ManagedServer(spec)
anyio.run(server.start)
print("UP", server.pid, flush=True)
sys.stdin.read()  # until SIGKILLed
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _server_pids(log: Path) -> list[int]:
    for _ in range(100):
        for line in log.read_text().splitlines():
            if line.startswith("PIDS"):
                return [int(p) for p in line.split()[1:]]
        time.sleep(0.05)
    raise AssertionError(log.read_text())


def test_a_sigkilled_launcher_takes_its_server_group_with_it(tmp_path: Path) -> None:
    port, log = _port(), tmp_path / "server.log"
    argv = json.dumps([sys.executable, "-c", SERVER, str(port)])
    run = subprocess.Popen(
        [sys.executable, "-c", RUN, argv, f"http://127.0.0.1:{port}", str(log)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = run.stdout.readline() if run.stdout else ""
        assert line.startswith("UP"), line + log.read_text()
        leash = int(line.split()[1])
        pids = [leash, *_server_pids(log)]
        assert all(_alive(p) for p in pids)
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "server processes outlived the SIGKILLed run"
    finally:
        run.kill()
        for p in pids if "pids" in locals() else []:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_leash_reports_the_servers_own_exit(tmp_path: Path) -> None:
    """The launcher sees the server's status through the leash: an exit code, or death by a signal."""

    codes: list[int | None] = []

    async def run_one(argv: tuple[str, ...]) -> int | None:
        server = ManagedServer(ServerSpec("x", argv, "http://127.0.0.1:9", tmp_path / "s.log"))
        server._spawn()
        while server.alive():
            await anyio.sleep(0.05)
        code = server.exit_code()
        await server.stop()
        return code

    for argv in (
        (sys.executable, "-c", "raise SystemExit(3)"),
        (sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"),
    ):
        codes.append(anyio.run(run_one, argv))
    assert codes == [3, -9]


def test_a_port_taken_before_the_server_binds_it_gets_another_port() -> None:
    """free_port() only says a port was free when asked: a server that lost it to another process
    (vLLM: 'Address already in use') starts again on a new one; a configured port is never changed."""
    from miles_env.engines._launch import on_a_free_port
    from miles_env.errors import EngineError

    tried: list[int] = []

    async def start(port: int) -> int:
        tried.append(port)
        if len(tried) == 1:
            raise EngineError(
                "vllm server exited with status 1 while starting:\nOSError: [Errno 98] Address already in use"
            )
        return port

    assert anyio.run(on_a_free_port, start, None) == tried[-1] and len(tried) == 2
    tried.clear()
    with pytest.raises(EngineError, match="Address already in use"):
        anyio.run(on_a_free_port, start, 8123)  # the user's port: their failure to see
    assert tried == [8123]

    async def broken(port: int) -> int:
        tried.append(port)
        raise EngineError("vllm server exited with status 1 while starting: out of memory")

    tried.clear()
    with pytest.raises(EngineError, match="out of memory"):
        anyio.run(on_a_free_port, broken, None)
    assert len(tried) == 1  # only a lost port is retried
