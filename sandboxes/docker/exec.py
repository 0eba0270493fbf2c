"""Blocking Docker exec with stdin, a deadline, output caps and kill-by-token (runs in a worker thread).

The exec's hijacked connection carries Docker's multiplexed stream (8-byte
frame header: stream id, 3 zero bytes, big-endian length). stdin is written
by a helper thread and then half-closed, which the engine turns into EOF.
When the deadline passes, the output passes `kill_factor` x cap, or `stop`
is set (the caller was cancelled), every process in the container whose
environment carries `MILES_EXEC=<token>` is SIGKILLed by a second exec, then
the stream is drained to EOF so the output's tail is kept.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles_env.errors import SandboxError

from ..results import RawResult

__all__ = ["ExecOutcome", "run_exec", "kill_token_argv", "start_detached"]

_KILL = (
    't="MILES_EXEC=$1"; for round in 1 2 3; do for p in /proc/[0-9]*; do '
    'tr "\\0" "\\n" < "$p/environ" 2>/dev/null | grep -qxF "$t" && kill -9 "${p#/proc/}" 2>/dev/null; '
    "done; done; true"
)


def kill_token_argv(token: str) -> list[str]:
    return ["/bin/sh", "-c", _KILL, "sh", token]


def _kill(api: Any, container: str, token: str, user: str) -> None:
    try:
        api.exec_start(api.exec_create(container, kill_token_argv(token), user=user)["Id"])
    except Exception:  # noqa: BLE001 - the container is gone: nothing is left to kill
        pass


@dataclass(frozen=True, slots=True)
class ExecOutcome:
    raw: RawResult
    exec_id: str


class _Demux:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.buf = bytearray()
        self.out = bytearray()
        self.err = bytearray()
        self.seen = [0, 0]

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        while len(self.buf) >= 8:
            n = int.from_bytes(self.buf[4:8], "big")
            if len(self.buf) < 8 + n:
                return
            kind, data = self.buf[0], bytes(self.buf[8 : 8 + n])
            del self.buf[: 8 + n]
            i, target = (1, self.err) if kind == 2 else (0, self.out)
            room = self.cap - len(target)
            if room > 0:
                target += data[:room]
            self.seen[i] += len(data)


def _raw_socket(obj: Any) -> socket.socket:
    sock = getattr(obj, "_sock", obj)
    if not isinstance(sock, socket.socket):
        raise SandboxError(f"docker exec: unexpected attach object {type(obj).__name__}")
    return sock


def _already_read(obj: Any) -> bytes:
    """Stream bytes the SDK's HTTP reader took off the socket with the upgrade's headers.

    exec_start(socket=True) hands back the raw socket under the response's buffered reader; for a
    command that exits at once, its output can arrive in the same read as the headers and sit in
    that buffer, where reading the socket never finds it (an exec's stderr came back empty).
    """
    reader = getattr(getattr(getattr(getattr(obj, "_response", None), "raw", None), "_fp", None), "fp", None)
    if reader is None:
        return b""
    try:
        data = reader.peek(1 << 16)  # what it holds (if empty, one read of the socket: the same bytes)
    except (OSError, ValueError):
        return b""
    return reader.read(len(data)) if data else b""


def _feed_stdin(sock: socket.socket, data: bytes, stop: threading.Event) -> None:
    view = memoryview(data)
    try:
        while view and not stop.is_set():
            try:
                view = view[sock.send(view) :]
            except TimeoutError:
                continue
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the command exited without reading all of its input


def _read(
    sock: socket.socket, demux: _Demux, until: float, stop: threading.Event | None, limit: int
) -> str | None:
    """Read frames until EOF (None) or a reason to stop: 'timeout', 'output', 'cancelled'."""
    while True:
        if stop is not None and stop.is_set():
            return "cancelled"
        if time.monotonic() >= until:
            return "timeout"
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return None
        if not chunk:
            return None
        demux.feed(chunk)
        if max(demux.seen) > limit:
            return "output"


def run_exec(
    api: Any,
    container: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str,
    stdin: bytes | None,
    timeout: float,
    cap: int,
    token: str,
    stop: threading.Event,
    kill_factor: int = 4,
    user: str = "",
) -> ExecOutcome:
    """`user`: `docker exec -u` ("": the container's user); the killer runs as the same user."""
    start = time.perf_counter()
    eid = api.exec_create(
        container, list(argv), stdin=stdin is not None, environment=dict(env), workdir=cwd, user=user
    )["Id"]
    attached = api.exec_start(eid, socket=True)
    sock = _raw_socket(attached)
    sock.settimeout(0.05)
    demux = _Demux(cap)
    demux.feed(_already_read(attached))
    try:
        if stdin is not None:
            threading.Thread(target=_feed_stdin, args=(sock, stdin, stop), daemon=True).start()
        reason = _read(sock, demux, time.monotonic() + timeout, stop, cap * kill_factor + 65536)
        if reason is not None:
            # Keep draining while the killer runs: an engine whose output pipe is
            # full may not start another exec in the same container.
            killer = threading.Thread(target=_kill, args=(api, container, token, user), daemon=True)
            killer.start()
            _read(sock, demux, time.monotonic() + 5.0, None, 1 << 62)
            killer.join(5.0)
    finally:
        stop.set()  # ends the stdin thread
        sock.close()
    code = None
    for _ in range(100):
        info = api.exec_inspect(eid)
        if not info.get("Running"):
            code = info.get("ExitCode")
            break
        time.sleep(0.02)
    return ExecOutcome(
        RawResult(
            returncode=137 if code is None else int(code),
            stdout=bytes(demux.out),
            stderr=bytes(demux.err),
            timed_out=reason == "timeout",
            output_killed=reason == "output",
            truncated=max(demux.seen) > cap,
            duration_s=time.perf_counter() - start,
        ),
        eid,
    )


def start_detached(
    api: Any, container: str, argv: Sequence[str], ready: bytes, timeout: float
) -> socket.socket:
    """Start a long-running exec and wait until its stdout shows `ready`; return its open connection."""
    eid = api.exec_create(container, list(argv))["Id"]
    attached = api.exec_start(eid, socket=True)
    sock = _raw_socket(attached)
    sock.settimeout(0.05)
    demux = _Demux(1 << 16)
    demux.feed(_already_read(attached))
    until = time.monotonic() + timeout
    while ready not in demux.out:
        if _read_some(sock, demux) is False or time.monotonic() > until:
            sock.close()
            raise SandboxError(
                f"expose: the in-sandbox forwarder did not start: {(demux.out + demux.err)[-500:]!r}"
            )
    return sock


def _read_some(sock: socket.socket, demux: _Demux) -> bool:
    try:
        chunk = sock.recv(65536)
    except TimeoutError:
        return True
    except OSError:
        return False
    if not chunk:
        return False
    demux.feed(chunk)
    return True
