"""expose() plumbing shared by the providers that run on this host (local, docker).

Concept: a sandbox without a network reaches a host HTTP endpoint through a socket that
a `HostListener` accepts on, in our process, copying each connection's bytes to the TCP
endpoint (one pair of pump threads per connection, so it is independent of any event loop).
Docker: a Unix socket in a host directory the container sees at `INNER_RUN`, and inside,
`FORWARDER` (forwarder.py, stdlib only, run by the container's python3) listening on
127.0.0.1:PORT and copying each connection to it. Local: the listening socket itself lives in
the sandbox's network namespace (the zygote made it), so nothing runs inside (`HostListener.on`).
Bytes are forwarded as they arrive, so SSE streams pass unbuffered.

Lifecycle: the provider makes one listener per expose() and closes it with the
sandbox (`HostListener.close()` also ends the connections in flight).
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from miles_env.errors import SandboxError

__all__ = ["FORWARDER", "INNER_RUN", "ExposeTarget", "HostListener"]

FORWARDER = Path(__file__).with_name("forwarder.py")  # copied into the sandbox's run dir
INNER_RUN = "/run/miles-env"  # where the sandbox sees its run dir (sockets and forwarder.py)


@dataclass(frozen=True, slots=True)
class ExposeTarget:
    """The parts of an expose() URL a provider needs: where to connect, what to hand back."""

    scheme: str
    host: str
    port: int
    tail: str  # path and query, appended to the URL returned to the caller

    @classmethod
    def parse(cls, url: str) -> ExposeTarget:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SandboxError(f"expose({url!r}): expected an http(s) URL with a host")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        tail = parts.path + (f"?{parts.query}" if parts.query else "")
        return cls(parts.scheme, parts.hostname, port, tail)


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


class HostListener:
    """Unix socket `path` (or any listening socket: `on()`) -> TCP `target`, two pump threads a connection."""

    def __init__(self, path: str, target: tuple[str, int], sock: socket.socket | None = None) -> None:
        self.target = target
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            sock.listen(128)
        self.sock = sock
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"expose:{path}", daemon=True).start()

    @classmethod
    def on(cls, sock: socket.socket, target: tuple[str, int]) -> HostListener:
        """Serve a socket that is already listening (the local provider's, inside a sandbox's network)."""
        sock.setblocking(True)
        return cls(f"fd {sock.fileno()}", target, sock)

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
