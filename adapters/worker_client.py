"""The worker RPC client: a framework's code runs in its own venv, driven over stdio JSON lines.

Concept: `WorkerClient` starts `<venv python> adapters/workers/<script>` and talks
to it with one JSON object per line. Host -> worker: `{"id", "method", "params"}`;
worker -> host: `{"id", "result"}` or `{"id", "error": {"type", "message"}}`. The
worker may also call back into the host (`{"cb", "method", "params"}`, answered
with `{"cb", "result" | "error"}`), which is how a framework's environment class
reaches one of our sandboxes. The first line a worker writes is
`{"ready": true, ...}` (framework version, start time).

Invariant: a worker that crashes, hangs (no answer within the call's timeout) or
writes a line that is not a protocol message makes every pending call raise
`WorkerError` carrying the reason and the tail of its stderr; the client then
kills it and starts a fresh one on the next call. A worker failure is never
raised past an episode: adapters turn it into Status.FAILED with the error kept.
A reply to a request the host cancelled (`{"cancel": id}`) is expected, not a
protocol error: the worker's handler may answer (CancelledError, or the result it
finished just before the cancel arrived) after the caller has gone; it is dropped.

Lifecycle: started lazily by the first `call`, reused for every episode of the
same event loop, closed by `aclose()` (kill after a short grace period).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio.streams.text import TextReceiveStream

from miles_env.errors import MilesEnvError
from miles_env.types import EpisodeEnd

__all__ = ["WorkerError", "WorkerClient", "worker_script", "call_once", "Callback"]

WORKERS_DIR = Path(__file__).resolve().parent / "workers"
Callback = Callable[[dict[str, Any]], Awaitable[Any]]
_LINE_LIMIT = 64 << 20  # one protocol line (an episode's transcript) may be large
_CANCELLED_KEPT = 4096  # cancelled ids remembered for their late replies


class WorkerError(MilesEnvError):
    """The framework worker crashed, hung, or spoke something other than the protocol."""

    end = EpisodeEnd.ADAPTER_WORKER


def worker_script(name: str) -> Path:
    path = WORKERS_DIR / name
    if not path.is_file():
        raise WorkerError(f"worker script {path} is missing (package data not installed?)")
    return path


class WorkerClient:
    """One worker process; concurrent calls are multiplexed by id."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        name: str = "worker",
        start_timeout_s: float = 120.0,
        opener: Callable[[], Awaitable[anyio.abc.Process]] | None = None,
    ) -> None:
        self.argv = list(argv)
        # Why an opener: the same protocol runs over a process started elsewhere (inside a
        # sandbox, `sandboxes/local/spawn.py`); None = a plain child process with `argv`.
        self.opener = opener
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.name = name
        self.start_timeout_s = start_timeout_s
        self.callbacks: dict[str, Callback] = {}
        self.ready_info: dict[str, Any] = {}
        self.start_s = 0.0
        self._proc: anyio.abc.Process | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: dict[int, tuple[anyio.Event, list[Any]]] = {}
        # Ids whose caller was cancelled: their late replies are dropped (bounded: a worker may
        # never answer a cancel, e.g. when the request had already finished unseen).
        self._cancelled: dict[int, None] = {}
        self._next = 0
        self._stderr: deque[str] = deque(maxlen=40)
        self._dead: str | None = None
        self._lock = anyio.Lock()
        self._write_lock = anyio.Lock()
        self._ready = anyio.Event()
        self._loop: object | None = None

    def stderr_tail(self) -> str:
        return "".join(self._stderr)[-2000:]

    async def _start(self) -> None:
        t0 = time.perf_counter()
        self._dead, self._ready, self._pending, self._cancelled = None, anyio.Event(), {}, {}
        self._stderr.clear()
        if self.opener is not None:
            self._proc = await self.opener()
        else:
            self._proc = await anyio.open_process(self.argv, env=self.env, start_new_session=True)
        self._loop = _loop_id()
        self._spawn(self._read_stdout())
        self._spawn(self._read_stderr())
        with anyio.move_on_after(self.start_timeout_s):
            await self._ready.wait()
        if not self.ready_info:
            reason = self._dead or f"no ready line within {self.start_timeout_s}s"
            await self._kill(f"{self.name} worker failed to start: {reason}")
            raise WorkerError(f"{self.name} worker failed to start: {reason}\n{self.stderr_tail()}")
        self.start_s = time.perf_counter() - t0

    async def _read_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        async for chunk in TextReceiveStream(self._proc.stderr, errors="replace"):
            self._stderr.append(chunk)

    async def _read_stdout(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        buf = ""
        try:
            async for chunk in TextReceiveStream(self._proc.stdout, errors="replace"):
                buf += chunk
                if len(buf) > _LINE_LIMIT:
                    raise WorkerError(f"a line longer than {_LINE_LIMIT} bytes")
                while "\n" in buf:
                    line, buf = buf.split("\n", 1)
                    if line.strip():
                        self._dispatch(line)
            await self._proc.wait()
            self._fail(f"{self.name} worker exited with code {self._proc.returncode}")
        except WorkerError as e:
            self._fail(f"{self.name} worker protocol error: {e}")
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as e:  # a broken pipe or decoding fault is a dead worker, not our crash
            self._fail(f"{self.name} worker stream failed: {type(e).__name__}: {e}")

    def _dispatch(self, line: str) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            raise WorkerError(f"not JSON: {line[:200]!r}") from None
        if not isinstance(msg, dict):
            raise WorkerError(f"not a JSON object: {line[:200]!r}")
        if msg.get("ready") is True:
            self.ready_info = msg
            self._ready.set()
        elif "cb" in msg:
            self._spawn(self._answer_callback(msg))
        elif (
            isinstance(msg.get("id"), int)
            and msg["id"] in self._pending
            and ("result" in msg or "error" in msg)
        ):
            event, slot = self._pending[msg["id"]]
            slot.append(msg)
            event.set()
        elif msg.get("id") in self._cancelled and ("result" in msg or "error" in msg):
            del self._cancelled[msg["id"]]  # the late answer to a cancelled call: nobody waits
        else:
            raise WorkerError(f"unexpected message: {line[:200]!r}")

    async def _answer_callback(self, msg: dict[str, Any]) -> None:
        handler = self.callbacks.get(str(msg.get("method")))
        reply: dict[str, Any] = {"cb": msg["cb"]}
        try:
            if handler is None:
                raise WorkerError(f"no host callback {msg.get('method')!r}")
            reply["result"] = await handler(msg.get("params") or {})
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as e:  # the worker gets the error; the framework decides what it means
            reply["error"] = {"type": type(e).__name__, "message": str(e)}
        await self._send(reply)

    def _fail(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        self._ready.set()
        for event, slot in self._pending.values():
            if not slot:
                slot.append({"_dead": self._dead})
            event.set()

    async def _send(self, msg: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        data = (json.dumps(msg, default=str) + "\n").encode()
        async with self._write_lock:
            await self._proc.stdin.send(data)

    async def _ensure(self) -> None:
        if self._loop != _loop_id():
            self._abandon()
        async with self._lock:
            if self._proc is not None and self._dead is not None:
                await self._kill("restart")
            if self._proc is None:
                await self._start()

    def _abandon(self) -> None:
        """Drop a worker started under another (finished) event loop: kill it by pid, start afresh."""
        if self._proc is not None:
            _killpg(self._proc.pid)
        self._proc, self.ready_info, self._tasks = None, {}, set()
        self._lock, self._write_lock, self._ready = anyio.Lock(), anyio.Lock(), anyio.Event()
        self._pending, self._cancelled, self._dead, self._loop = {}, {}, None, _loop_id()

    async def call(self, method: str, params: Any = None, *, timeout: float = 600.0) -> Any:
        """Send one request and wait for its answer; WorkerError on crash, hang or garbage."""
        await self._ensure()
        self._next += 1
        rid = self._next
        event, slot = anyio.Event(), list[Any]()
        self._pending[rid] = (event, slot)
        try:
            try:
                await self._send({"id": rid, "method": method, "params": {} if params is None else params})
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as e:
                self._fail(f"{self.name} worker stdin closed: {e}")
            try:
                with anyio.move_on_after(timeout) as scope:
                    await event.wait()
            except anyio.get_cancelled_exc_class():
                await self._cancel_remote(rid)
                raise
            if scope.cancelled_caught:
                reason = f"{self.name} worker did not answer {method!r} within {timeout}s"
                await self._kill(reason)
                raise WorkerError(f"{reason}\n{self.stderr_tail()}")
        finally:
            self._pending.pop(rid, None)
        msg = slot[0]
        if "_dead" in msg:
            dead = msg["_dead"]
            await self._kill(dead)
            raise WorkerError(f"{dead}\n{self.stderr_tail()}")
        if "error" in msg:
            err = msg["error"] if isinstance(msg["error"], dict) else {"message": str(msg["error"])}
            raise WorkerError(f"{self.name} worker: {err.get('type', 'Error')}: {err.get('message', '')}")
        return msg["result"]

    async def _cancel_remote(self, rid: int) -> None:
        """Our caller was cancelled: ask the worker to cancel request `rid` too (best effort)."""
        self._cancelled[rid] = None
        while len(self._cancelled) > _CANCELLED_KEPT:
            del self._cancelled[next(iter(self._cancelled))]
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            try:
                await self._send({"cancel": rid})
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass

    async def _kill(self, reason: str) -> None:
        self._fail(reason)
        proc, tasks = self._proc, list(self._tasks)
        self._proc, self.ready_info = None, {}
        if proc is not None:
            with anyio.CancelScope(shield=True):
                try:
                    if proc.stdin is not None:
                        await proc.stdin.aclose()
                    with anyio.move_on_after(2):
                        await proc.wait()
                    if proc.returncode is None:
                        _killpg(proc.pid)
                        await proc.wait()
                except (OSError, anyio.BrokenResourceError):
                    pass
        current = asyncio.current_task()
        for task in tasks:
            if task is not current:
                task.cancel()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        # Why bare asyncio tasks: the readers outlive any one call, and an anyio task
        # group cannot be entered by one call and left by another.
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        if self._loop != _loop_id():  # started under a loop that has ended: nothing to await on
            self._abandon()
            return
        async with self._lock:
            await self._kill("closed")


def _loop_id() -> object:
    try:
        return id(asyncio.get_running_loop())
    except RuntimeError:
        return None


def _killpg(pid: int) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def call_once(
    argv: Sequence[str],
    method: str,
    params: dict[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
) -> Any:
    """Synchronous one-shot call (listing tasks from a sync `Environment.tasks()`)."""
    request = json.dumps({"id": 1, "method": method, "params": params}) + "\n"
    try:
        r = subprocess.run(
            list(argv),
            input=request,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    except subprocess.TimeoutExpired as e:
        raise WorkerError(f"worker {argv[-1]} did not answer {method!r} within {timeout}s") from e
    except OSError as e:
        raise WorkerError(f"worker {argv[0]} could not start: {e}") from e
    for line in r.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and msg.get("id") == 1:
            if "error" in msg:
                err = msg["error"]
                raise WorkerError(f"worker {method!r}: {err.get('type')}: {err.get('message')}")
            return msg["result"]
    raise WorkerError(
        f"worker {argv[-1]} gave no answer to {method!r} (exit {r.returncode}): {r.stderr[-2000:]}"
    )


def python_argv(python: str | Path, script: str, *args: str) -> list[str]:
    return [str(python), "-u", str(worker_script(script)), *args]


if sys.platform == "win32":  # pragma: no cover
    raise ImportError("miles_env.adapters needs a POSIX system")
