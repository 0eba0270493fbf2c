"""A throwaway redis-server for tests and benchmarks: Debian's binary, a free port, a temp dir, AOF on.

Never the system service: each `RedisServer` starts its own process (scripts/install-redis.sh
installs the binary), with `appendonly yes` and the chosen `appendfsync`, no RDB snapshots, so
what survives a restart is exactly what the AOF holds. `kill9()` is the crash a fault test needs
(SIGKILL: no shutdown, no final flush); `start()` again reloads the AOF on the same port.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from miles_env.http import free_port

__all__ = ["RedisServer"]


class RedisServer:
    def __init__(self, directory: Path, *, appendfsync: str = "always") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run scripts/install-redis.sh (as root)")
        self.binary = binary
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.appendfsync = appendfsync
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30.0) -> RedisServer:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
            "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "",
            "--daemonize", "no", "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    if client.ping() and client.info("persistence").get("loading") == 0:
                        return self
                except redis.ConnectionError:  # not listening yet, or still loading its AOF
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server on port {self.port} did not come up:\n{log}")
                time.sleep(0.02)
        finally:
            client.close()

    def kill9(self) -> None:
        """SIGKILL the server (a crash), and reap it."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill9()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
