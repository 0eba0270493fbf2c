"""Isolation of framework workers: each episode's worker runs inside a bubblewrap sandbox.

Concept: with `isolation="sandbox"` (the default), an adapter episode does not use
the shared host worker: it spawns a fresh worker (`sandboxes/local/spawn.py`)
inside the episode's own local sandbox, so the framework's agent loop, its tools
and its verifier run with no network, a private writable workspace and /tmp, and
only these host paths visible, read-only at the same place: the framework venv,
the Python it was made from, our worker scripts, and the files the environment
names (a taskset module, an env file, a data file). The model is reached through
the sandbox's expose() bridge (`http://127.0.0.1:PORT/...` inside), the RPC over
the worker's stdio. When the episode's sandbox is not a local one (docker, a
cloud), a private local sandbox is made for the worker and closed with the episode.
`isolation="none"` keeps the pooled host worker (faster start, no isolation).

Invariant: a sandboxed worker never outlives its episode: it is killed on exit
of `episode_worker` and its sandbox is closed by the rollout (or by us).

Lifecycle: `async with episode_worker(...) as (client, base_url)` per episode.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from anyio.abc import Process

from miles_env.adapters.venv import get_spec, venv_dir, venv_python
from miles_env.adapters.worker_client import WORKERS_DIR, WorkerClient, python_argv
from miles_env.adapters.worker_pool import worker_for
from miles_env.errors import ConfigError, MilesEnvError
from miles_env.harness import Endpoint
from miles_env.sandbox import Sandbox
from miles_env.types import Resources, SandboxSpec

__all__ = [
    "Isolation",
    "WORKER_RESOURCES",
    "adapter_sandbox_spec",
    "episode_worker",
    "isolation_of",
    "ro_paths",
]

# Why generous limits: a framework (its event loop, thread pools, an HTTP server or two)
# maps far more address space than it uses; ulimit -v counts mappings, not pages.
WORKER_RESOURCES = Resources(memory_mb=16384, max_procs=1024, cpu_seconds=1800, timeout_s=600, disk_mb=2048)
_SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")


class Isolation(StrEnum):
    SANDBOX = "sandbox"
    NONE = "none"


def isolation_of(value: object) -> Isolation:
    """The `isolation` harness option (`--harness-opt isolation=none`), validated."""
    try:
        return Isolation(str(value) if value is not None else Isolation.SANDBOX)
    except ValueError:
        raise ConfigError(f"harness option isolation={value!r}: expected 'sandbox' or 'none'") from None


def adapter_sandbox_spec() -> SandboxSpec:
    """The episode sandbox of an adapter environment: room for a framework worker inside."""
    return SandboxSpec(resources=WORKER_RESOURCES)


def _base_prefix(adapter: str) -> str | None:
    """The installation prefix of the Python the venv was made from (pyvenv.cfg `home`/..)."""
    cfg = venv_dir(adapter) / "pyvenv.cfg"
    try:
        lines = cfg.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() == "home" and value.strip():
            return str(Path(value.strip()).parent)
    return None


def ro_paths(adapter: str, extra: Iterable[str] = ()) -> list[str]:
    """Host paths the worker needs, read-only: venv, base Python, worker scripts, `extra`.

    System directories are already in every sandbox and are left out; a path below
    another one is left out too (its parent's bind shows it, and bwrap cannot make a
    mount point inside a read-only bind).
    """
    wanted = [str(venv_dir(adapter)), _base_prefix(adapter), str(WORKERS_DIR), *extra]
    out: list[str] = []
    for raw in sorted({os.path.abspath(p) for p in wanted if p}, key=len):
        if any(raw == s or raw.startswith(s + "/") for s in _SYSTEM):
            continue
        if any(raw == o or raw.startswith(o.rstrip("/") + "/") for o in out):
            continue
        if os.path.exists(raw):
            out.append(raw)
    return out


@asynccontextmanager
async def _worker_box(sandbox: Sandbox) -> AsyncIterator[Any]:
    """The episode's sandbox when it is a local one, else a private local sandbox."""
    from miles_env.sandboxes.local import LocalSandbox, LocalSandboxProvider

    if isinstance(sandbox, LocalSandbox):
        yield sandbox
        return
    own = await LocalSandboxProvider().create(adapter_sandbox_spec())
    async with own:
        yield own


@asynccontextmanager
async def episode_worker(
    adapter: str,
    script: str,
    args: Iterable[str],
    *,
    sandbox: Sandbox,
    endpoint: Endpoint,
    isolation: Isolation = Isolation.SANDBOX,
    mounts: Iterable[str] = (),
) -> AsyncIterator[tuple[WorkerClient, str]]:
    """(worker, model base URL as the worker sees it) for one episode.

    `mounts` are the environment's own files (read-only inside). With isolation "none"
    the shared host worker for (adapter, script, args) and the endpoint's own URL.
    """
    args = tuple(args)
    if isolation is Isolation.NONE:
        yield worker_for(adapter, script, *args), endpoint.base_url
        return
    from miles_env.sandboxes.local.spawn import release, spawn

    python = venv_python(adapter)
    if not python.exists():
        raise MilesEnvError(
            f"adapter {adapter!r} is not installed: run `miles-env adapters install {adapter}`"
        )
    spec = get_spec(adapter)
    async with _worker_box(sandbox) as box:
        for path in ro_paths(adapter, mounts):
            if path not in box.mounts_ro:
                box.mount_ro(path, path)
        base_url = await box.expose(endpoint.base_url)
        # A URL argument (an OpenEnv server already running on the host) is bridged too.
        args = tuple([await box.expose(a) if a.startswith(("http://", "https://")) else a for a in args])
        argv = python_argv(python, script, *args)
        started: list[Process] = []

        async def opener() -> Process:
            proc = await spawn(box, argv, env={"PYTHONUNBUFFERED": "1", **spec.env})
            started.append(proc)
            return proc

        client = WorkerClient(argv, env=spec.env, name=f"{adapter} (sandboxed)", opener=opener)
        try:
            yield client, base_url
        finally:
            await client.aclose()
            for proc in started:
                release(box, proc)
