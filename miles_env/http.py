"""Serve an ASGI app on loopback inside the running event loop.

Lifecycle: `async with serve_app(app) as url:` starts uvicorn on a free port,
waits until it accepts connections, yields its base URL, and shuts it down on
exit (also on cancellation). Used for the TITO proxy and the SGLang-compatible
engine server when they run in the same process as the orchestrator.

Stack: uvicorn with the httptools parser when installed (h11 otherwise). A server started
here runs in the caller's event loop, so the loop is chosen where the loop starts:
`anyio.run(..., backend_options=loop_options())` runs on uvloop when it is installed.
Measured with bench/bench_tito.py: the two together take ~0.2 ms off the HTTP floor.
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

__all__ = ["serve_app", "free_port", "server_options", "loop_options"]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def server_options() -> dict[str, Any]:
    """uvicorn.Config options for the fastest installed HTTP stack."""
    return {"http": "httptools" if _installed("httptools") else "h11"}


def loop_options() -> dict[str, Any]:
    """`anyio.run` backend options: uvloop when installed, the asyncio default loop otherwise."""
    return {"use_uvloop": True} if _installed("uvloop") else {}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _quiet_server_class() -> Any:
    import uvicorn

    class QuietServer(uvicorn.Server):
        """A uvicorn server that leaves signal handling to the caller (the CLI owns Ctrl-C)."""

        def capture_signals(self) -> Any:
            return contextlib.nullcontext()

        def install_signal_handlers(self) -> None:  # older uvicorn releases
            return None

    return QuietServer


@asynccontextmanager
async def serve_app(
    app: Any, host: str = "127.0.0.1", port: int = 0, **uvicorn_kw: Any
) -> AsyncIterator[str]:
    import uvicorn

    _QuietServer = _quiet_server_class()
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when the listening
    # socket says so; without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=30,
        **(server_options() | uvicorn_kw),
    )
    server = _QuietServer(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        with anyio.fail_after(30):
            while not server.started:
                await anyio.sleep(0.01)
        try:
            yield f"http://{host}:{bound_port}"
        finally:
            server.should_exit = True
            tg.cancel_scope.deadline = anyio.current_time() + 5
    sock.close()
