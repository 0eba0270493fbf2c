"""expose(): make a host HTTP endpoint reachable inside a sandbox that has no network.

Concept: host side, a Unix socket `<sandbox>/run/expose-N.sock` accepts
connections and copies bytes to the host TCP endpoint (threads, so it is
independent of the caller's event loop). Sandbox side, a tiny stdlib forwarder
(forwarder.py) listens on 127.0.0.1:INNER inside a network namespace and copies
to that socket. The first expose() starts the forwarder in a fresh bwrap whose
network namespace then becomes the sandbox's: later execs (and forwarders) join
it (`netns()`: nsenter, or the zygote itself) as root before dropping to the
sandbox's uid, so they still see only `lo`, now with the bridge on it. The
forwarder has no capabilities, so a host port below 1024 is served inside on a
port from 20000 up.

Lifecycle: created on the first expose(); `aclose()` (from Sandbox.close) kills
the forwarders and closes every host socket. Bytes are forwarded as they
arrive, so SSE streams pass unbuffered.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from urllib.parse import urlsplit

import anyio
from anyio.abc import Process

from miles_env.errors import SandboxError

__all__ = ["Bridge"]

_FORWARDER = Path(__file__).with_name("forwarder.py")
_INNER_RUN = "/run/miles-env"


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class _HostListener:
    """Unix socket -> TCP (host, port), one pair of pump threads per connection."""

    def __init__(self, path: str, target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(128)
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"expose:{path}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inner, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(inner,), daemon=True).start()

    def _serve(self, inner: socket.socket) -> None:
        try:
            outer = socket.create_connection(self.target, timeout=10)
        except OSError:
            inner.close()
            return
        outer.settimeout(None)
        outer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.lock:
            self.conns.update((inner, outer))
        back = threading.Thread(target=_pump, args=(outer, inner), daemon=True)
        back.start()
        _pump(inner, outer)
        back.join()
        with self.lock:
            self.conns.difference_update((inner, outer))
        inner.close()
        outer.close()

    def close(self) -> None:
        # shutdown() wakes the thread blocked in accept(); close() alone may not.
        for s in [self.sock, *self.conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class Bridge:
    def __init__(
        self,
        run_dir: Path,
        bwrap_prefix: list[str],
        limit_prefix: list[str],
        drop_prefix: list[str],
        python: str,
    ) -> None:
        self.run_dir = run_dir
        self.bwrap_prefix = bwrap_prefix
        self.limit_prefix = limit_prefix
        self.drop_prefix = drop_prefix
        self.python = python
        self.listeners: list[_HostListener] = []
        self.processes: list[Process] = []
        self.ns_pid: int | None = None
        self.ports: set[int] = set()
        self.lock = anyio.Lock()
        shutil.copyfile(_FORWARDER, run_dir / "forwarder.py")

    def netns(self) -> str | None:
        """The sandbox's network namespace once the first forwarder made it."""
        return f"/proc/{self.ns_pid}/ns/net" if self.ns_pid else None

    def _inner_port(self, port: int) -> int:
        inner = port if port >= 1024 else 20000
        while inner in self.ports:
            inner = 20000 + len(self.ports) if inner < 20000 else inner + 1
        self.ports.add(inner)
        return inner

    async def expose(self, url: str, live: set[int]) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SandboxError(f"expose({url!r}): expected an http(s) URL with a host")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        async with self.lock:
            n = len(self.listeners)
            sock_path = self.run_dir / f"expose-{n}.sock"
            self.listeners.append(_HostListener(str(sock_path), (parts.hostname, port)))
            os.chmod(
                sock_path, 0o666
            )  # the forwarder runs as the sandbox's uid (the host port is open to all anyway)
            inner = self._inner_port(port)
            await self._start_forwarder(inner, f"{_INNER_RUN}/expose-{n}.sock", live)
        tail = parts.path + (f"?{parts.query}" if parts.query else "")
        return f"{parts.scheme}://127.0.0.1:{inner}{tail}"

    async def _start_forwarder(self, inner_port: int, inner_sock: str, live: set[int]) -> None:
        first = self.ns_pid is None
        bwrap = list(self.bwrap_prefix)
        # Mount points must be made before the root is remounted read-only.
        at = bwrap.index("--remount-ro")
        bwrap[at:at] = ["--bind", str(self.run_dir), _INNER_RUN]
        outer = ["nsenter", f"--net={netns}", "--"] if (netns := self.netns()) else []
        argv = [*self.limit_prefix, *outer, *self.drop_prefix, *bwrap]
        if not first:
            argv.append("--share-net")
        read_fd, write_fd = os.pipe()
        argv += ["--info-fd", str(write_fd), "--"]
        argv += [self.python, "-u", f"{_INNER_RUN}/forwarder.py", str(inner_port), inner_sock]
        try:
            proc = await anyio.open_process(
                argv, stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(write_fd,)
            )
        finally:
            os.close(write_fd)
        self.processes.append(proc)
        live.add(proc.pid)
        with os.fdopen(read_fd, "rb") as info_pipe:
            info = await anyio.to_thread.run_sync(info_pipe.read)
        assert proc.stdout is not None
        line = b""
        with anyio.move_on_after(20):
            try:
                line = await proc.stdout.receive()
            except anyio.EndOfStream:
                pass
        if not line.startswith(b"READY"):
            err = b""
            if proc.stderr is not None:
                with anyio.move_on_after(1):
                    try:
                        err = await proc.stderr.receive()
                    except anyio.EndOfStream:
                        pass
            raise SandboxError(f"expose: the in-sandbox forwarder did not start: {(line + err)[-500:]!r}")
        if first:
            self.ns_pid = int(json.loads(info)["child-pid"])

    async def aclose(self) -> None:
        for proc in self.processes:
            try:
                os.killpg(proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.processes:
            await proc.wait()
            await proc.aclose()
        for listener in self.listeners:
            listener.close()
