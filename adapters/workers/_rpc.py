"""Worker side of the miles-env adapter protocol (stdlib only; runs inside a framework's venv).

`serve(handlers, info)` takes fd 1 for the protocol and points sys.stdout (and fd 1
of child processes) at stderr, so a framework that prints cannot corrupt the
stream. Requests run concurrently as asyncio tasks; `{"cancel": id}` from the
host cancels request `id`'s task (its handler sees CancelledError and can clean
up, e.g. a Harbor trial stops its agent), and it answers with an error.
`await host_call(method, params)` calls back into the host (for example, a
sandbox exec).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

Handler = Callable[[dict[str, Any]], Awaitable[Any]]
_T0 = time.perf_counter()
_out: Any = None
_pending: dict[int, asyncio.Future[Any]] = {}
_next_cb = 0


def _write(msg: dict[str, Any]) -> None:
    _out.write(json.dumps(msg, default=str) + "\n")
    _out.flush()


async def host_call(method: str, params: dict[str, Any]) -> Any:
    global _next_cb
    _next_cb += 1
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    _pending[_next_cb] = fut
    _write({"cb": _next_cb, "method": method, "params": params})
    return await fut


async def _handle(handlers: dict[str, Handler], msg: dict[str, Any]) -> None:
    rid = msg.get("id")
    try:
        handler = handlers.get(msg.get("method", ""))
        if handler is None:
            raise KeyError(f"unknown method {msg.get('method')!r}")
        result = await handler(msg.get("params", {}))
        _write({"id": rid, "result": result})
    except BaseException as e:  # report everything; the host decides
        traceback.print_exc(file=sys.stderr)
        _write({"id": rid, "error": {"type": type(e).__name__, "message": str(e)}})


def _forget(by_id: dict[Any, Any], rid: Any, _task: Any) -> None:
    by_id.pop(rid, None)


async def _main(handlers: dict[str, Handler], info: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    _write({"ready": True, "pid": os.getpid(), "start_s": time.perf_counter() - _T0, **info})
    tasks: set[asyncio.Task[None]] = set()
    by_id: dict[Any, asyncio.Task[None]] = {}
    while True:
        line = await reader.readline()
        if not line:
            break
        msg = json.loads(line)
        if "cb" in msg:
            fut = _pending.pop(msg["cb"], None)
            if fut is not None and not fut.done():
                if "error" in msg:
                    fut.set_exception(
                        RuntimeError(f"{msg['error'].get('type')}: {msg['error'].get('message')}")
                    )
                else:
                    fut.set_result(msg.get("result"))
            continue
        if "cancel" in msg:
            running = by_id.get(msg["cancel"])
            if running is not None:
                running.cancel()
            continue
        task = asyncio.create_task(_handle(handlers, msg))
        tasks.add(task)
        rid = msg.get("id")
        by_id[rid] = task
        task.add_done_callback(tasks.discard)
        task.add_done_callback(functools.partial(_forget, by_id, rid))
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


def serve(handlers: dict[str, Handler], info: dict[str, Any] | None = None) -> None:
    global _out
    _out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    asyncio.run(_main(handlers, info or {}))
