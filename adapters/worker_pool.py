"""The host's pooled framework workers (`isolation="none"`, and Harbor's trial orchestrator).

Concept: one long-lived `WorkerClient` per (adapter, worker script, arguments), started on first
use in the adapter's venv and shared by every episode after it (`worker_for`); `close_workers`
closes them all. A sandboxed episode (isolation.py's default) starts its own worker instead.

Lifecycle: a pooled worker belongs to the event loop that started it; call `close_workers()`
before that loop ends (the job and the tests do).
"""

from __future__ import annotations

from miles_env.adapters.venv import get_spec, venv_python
from miles_env.adapters.worker_client import WorkerClient, python_argv
from miles_env.errors import MilesEnvError

__all__ = ["worker_for", "close_workers"]

_POOL: dict[tuple[str, str, str], WorkerClient] = {}


def worker_for(adapter: str, script: str, *args: str, argv: list[str] | None = None) -> WorkerClient:
    """The shared worker for (adapter, script, args); `argv` overrides the command (tests)."""
    key = (adapter, script, "\0".join(argv or args))
    client = _POOL.get(key)
    if client is None:
        spec = get_spec(adapter)
        if argv is None:
            python = venv_python(adapter)
            if not python.exists():
                raise MilesEnvError(
                    f"adapter {adapter!r} is not installed: run `miles-env adapters install {adapter}`"
                )
            argv = python_argv(python, script, *args)
        client = WorkerClient(argv, env=spec.env, name=adapter)
        _POOL[key] = client
    return client


async def close_workers() -> None:
    """Close every pooled worker (call before the event loop that started them ends)."""
    for client in list(_POOL.values()):
        await client.aclose()
