"""A managed inference-server subprocess (vLLM, SGLang): launch, health wait, logs, stop, restart.

Concept: `ManagedServer(spec)` owns one server process started in its own
process group (vLLM and SGLang fork engine-core/scheduler children; stopping
the group stops them all), on a leash (`_leash.py`): the group dies with the
process that launched it, even when that process is SIGKILLed. Its stdout and
stderr go to `spec.log_path`, appended across restarts, so a crash leaves its
traceback on disk; errors quote the log's tail.

Invariant: after `start()` returns the server answered `GET {health_path}` with
200; a process that exits during the wait fails fast with its exit code and log
tail instead of waiting out the timeout.

Lifecycle: `await start()` -> `alive()` / `healthy()` -> `await restart()` (stop
then start, same port and arguments) -> `await stop()` (SIGTERM to the group,
SIGKILL after `stop_grace_s`). `stop()` is idempotent.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio
import httpx

from miles_env.errors import EngineError

__all__ = ["ServerSpec", "ManagedServer", "log_tail", "on_a_free_port", "servable_model_dir"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_LEASH = Path(__file__).with_name("_leash.py")


@dataclass(frozen=True, slots=True)
class ServerSpec:
    name: str  # "vllm" | "sglang": used in messages
    argv: tuple[str, ...]
    url: str  # base URL the server will listen on
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # added to os.environ
    health_path: str = "/health"
    startup_timeout_s: float = 600.0
    stop_grace_s: float = 15.0
    nice: int = 0  # added niceness (a shared CPU machine)


async def on_a_free_port(start: Callable[[int], Awaitable[T]], port: int | None, tries: int = 3) -> T:
    """`start(port)`, on `port` when one is configured, else on a free loopback port picked anew
    while another process takes the picked one before the server binds it (free_port() only says
    the port was free when asked; seen with two servers starting at once: vLLM's bind failed with
    'Address already in use'). A configured port is the user's: its failure is theirs to see."""
    from miles_env.http import free_port

    for attempt in range(1, tries + 1):
        try:
            return await start(port or free_port())
        except EngineError as e:
            if port or attempt == tries or "Address already in use" not in str(e):
                raise
            log.warning("server port taken before it bound (try %d/%d); another port", attempt, tries)
    raise AssertionError("unreachable")


def log_tail(path: Path, n_chars: int = 2000) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - n_chars))
            return fh.read().decode(errors="replace")
    except OSError:
        return "(no log)"


class ManagedServer:
    """One server subprocess; see the module docstring for the lifecycle."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self._proc: subprocess.Popen[bytes] | None = None
        self._leash_fd: int | None = None  # the pipe's write end: closed (by us or by death) = stop
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exit_code(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def _spawn(self) -> None:
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env}
        nice = self.spec.nice
        self._unleash()  # a server that died by itself left its leash
        leash_r, self._leash_fd = os.pipe()  # both ends non-inheritable: only the leash gets one
        argv = [sys.executable, str(_LEASH), str(leash_r), str(self.spec.stop_grace_s), "--", *self.spec.argv]
        try:
            with self.spec.log_path.open("ab") as log:
                log.write(
                    f"\n=== miles-env: starting {self.spec.name}: {' '.join(self.spec.argv)}\n".encode()
                )
                log.flush()
                self._proc = subprocess.Popen(  # noqa: S603 - argv built from typed config
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    pass_fds=(leash_r,),
                    start_new_session=True,  # own process group: stop() reaches the forked children
                    preexec_fn=(lambda: os.nice(nice)) if nice else None,  # noqa: PLW1509
                )
        finally:
            os.close(leash_r)
        self.starts += 1

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                resp = await client.get(self.spec.url + self.spec.health_path)
            return resp.status_code == 200
        except httpx.HTTPError:
            return False

    async def start(self) -> None:
        if self.alive():
            return
        self._spawn()
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.exit_code()
            if code is not None:
                raise EngineError(
                    f"{self.spec.name} server exited with status {code} while starting "
                    f"(log {self.spec.log_path}):\n{log_tail(self.spec.log_path)}"
                )
            if await self.healthy(timeout_s=2.0):
                return
            await anyio.sleep(0.5)
        await self.stop()
        raise EngineError(
            f"{self.spec.name} server at {self.spec.url} not healthy after {self.spec.startup_timeout_s:.0f}s "
            f"(log {self.spec.log_path}):\n{log_tail(self.spec.log_path)}"
        )

    def _unleash(self) -> None:
        fd, self._leash_fd = self._leash_fd, None
        if fd is not None:
            os.close(fd)

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            self._unleash()
            return
        self._signal(proc, signal.SIGTERM)
        self._signal(proc, signal.SIGCONT)  # a stalled (stopped) server handles the TERM now
        deadline = time.monotonic() + self.spec.stop_grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            await anyio.sleep(0.1)
        if proc.poll() is None:
            self._signal(proc, signal.SIGKILL)
            await anyio.to_thread.run_sync(proc.wait)
        self._signal(proc, signal.SIGKILL)  # children that outlived the leader
        self._unleash()

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    async def restart(self) -> None:
        await self.stop()
        await self.start()


def servable_model_dir(model_dir: Path) -> Path:
    """`model_dir`, or a shadow of it that vLLM and SGLang can load.

    Our SmolLM2 checkpoint is converted from GGUF to plain float32 safetensors, but its
    config.json keeps the GGUF `quantization_config`, which vLLM (and SGLang) refuse. The
    shadow dir (under CACHE/engines/models) links every file and holds a config.json without it.
    """
    import hashlib
    import json

    from miles_env.models import cache_dir

    config = json.loads((model_dir / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") != "gguf":
        return model_dir
    del config["quantization_config"]
    key = hashlib.sha1(str(model_dir.resolve()).encode()).hexdigest()[:10]
    shadow = cache_dir() / "engines" / "models" / f"{model_dir.name}-{key}"
    shadow.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        link = shadow / f.name
        if f.name != "config.json" and not link.exists():
            link.symlink_to(f.resolve())
    tmp = shadow / f".config.json.{os.getpid()}"
    tmp.write_text(json.dumps(config, indent=2))
    os.replace(tmp, shadow / "config.json")  # atomic: a concurrent launch never reads half a file
    return shadow
