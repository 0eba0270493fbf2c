"""SGLang's own router (`sglang-router`, a Rust binary) as a managed process in front of several engines.

Concept: `start_router(urls, ...)` runs `python -m sglang_router.launch_router --worker-urls URLS
--policy manual` and returns once the router has registered every worker; `SGLangEngine` then
posts each `/generate` to the router with the session id in `X-SMG-Routing-Key`. The `manual`
policy maps a routing key to one worker on first sight (`--assignment-mode min_group`: the worker
holding the fewest keys) and keeps it there, so every turn of a session reaches the engine holding
its KV prefix; it remaps a key only when its worker turns unhealthy. The router forwards
`X-SMG-Routing-Key` to the worker (its header allow-list), and our embedded server takes it as
the session's KV-reuse hint, as it takes `X-Session-Id`.

Why `manual`, not `consistent_hashing`: 0.3.2's launcher offers random, round_robin, cache_aware,
power_of_two and manual only; `cache_aware` routes by an approximate prefix tree of the request
text (empty for token-id requests), not by session.

Engine death: retries are off (`--disable-retries`), so a turn in flight on a dead worker comes
back as the router's error, an EngineError: the episode ends with it, recorded, never replayed
elsewhere in silence. The router's health check (every `health_interval_s`, one failure is
enough) marks the worker unhealthy, and the sessions it held move to a live worker on their next
turn (a cold prefix there).

Lifecycle: a `ManagedServer` (its own process group, log under `log_dir`), stopped by the
engine's `close()`. Weight updates and cache flushes bypass the router and go to every worker.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx

from miles_env.engines._http import request
from miles_env.engines._launch import ManagedServer, ServerSpec, log_tail
from miles_env.errors import ConfigError, EngineError
from miles_env.http import free_port

__all__ = ["ROUTING_KEY_HEADER", "router_spec", "start_router", "router_workers", "router_add"]

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # the router's sticky key (forwarded to the worker)
ROUTER_ADD_S = 60.0  # for sglang-router to register a new worker as healthy (router_add)


def router_spec(
    urls: Sequence[str],
    port: int,
    log_path: Path,
    *,
    health_interval_s: int = 1,
    startup_timeout_s: float = 60.0,
    extra_args: Sequence[str] = (),
) -> ServerSpec:
    """The router's command line: sticky by routing key, no retries, a fast health check."""
    argv = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--worker-urls", *urls,
        "--host", "127.0.0.1", "--port", str(port),
        "--policy", "manual", "--assignment-mode", "min_group",
        "--disable-retries",
        "--health-check-interval-secs", str(health_interval_s),
        "--health-failure-threshold", "1", "--health-success-threshold", "1",
        "--health-check-timeout-secs", "2",
        "--log-level", "warn",
        # its metrics port defaults to 29000: two routers on one host (or one left closing) collide
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        *extra_args,
    ]  # fmt: skip
    return ServerSpec(
        "sglang-router", tuple(argv), f"http://127.0.0.1:{port}", log_path,
        health_path="/health", startup_timeout_s=startup_timeout_s, stop_grace_s=5.0,
    )  # fmt: skip


async def router_workers(client: httpx.AsyncClient, url: str) -> dict[str, bool]:
    """The router's registered workers: URL -> healthy (GET /workers)."""
    body: Any = (await client.get(f"{url}/workers")).json()
    out: dict[str, bool] = {}
    for w in body.get("workers", []) if isinstance(body, dict) else []:
        out[str(w.get("url", "")).rstrip("/")] = bool(w.get("is_healthy", w.get("healthy", True)))
    return out


async def start_router(
    urls: Sequence[str], port: int, log_path: Path, *, startup_timeout_s: float = 60.0
) -> ManagedServer:
    """Start the router and wait until it has registered every worker as healthy."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ConfigError("engine.router: sglang-router is not installed (pip install 'miles-env[scale]')")
    spec = router_spec(urls, port, log_path, startup_timeout_s=startup_timeout_s)
    server = ManagedServer(spec)
    await server.start()  # /health answers before the workers are registered (in the background)
    want = {u.rstrip("/") for u in urls}
    deadline = time.monotonic() + startup_timeout_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                seen = await router_workers(client, spec.url)
            except (httpx.HTTPError, ValueError):
                seen = {}
            if want <= {u for u, ok in seen.items() if ok}:
                return server
            await anyio.sleep(0.1)
    await server.stop()
    raise EngineError(
        f"sglang-router at {spec.url}: workers {sorted(want)} not all registered after "
        f"{startup_timeout_s:.0f}s (log {log_path}):\n{log_tail(log_path)}"
    )


async def router_add(client: httpx.AsyncClient, router: str, url: str) -> None:
    """Register `url` with sglang-router (`POST /workers`, queued) and wait until it is healthy there."""
    await request(client, "sglang-router", "POST", f"{router}/workers", json={"url": url})
    with anyio.fail_after(ROUTER_ADD_S):
        while not (await router_workers(client, router)).get(url):
            await anyio.sleep(0.2)
