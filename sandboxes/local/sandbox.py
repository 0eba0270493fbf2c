"""The local sandbox: one bubblewrap invocation per exec over a persistent private directory.

Concept: a sandbox is a host directory `<root>/<id>/` (workspace bound at
spec.workdir, a private /tmp) plus, when the host allows it, a pids cgroup. Each
exec is a single fresh `bwrap --unshare-all` (new user, mount, pid, net, ipc,
uts, cgroup namespaces) that sees only the read-only system dirs and those two
writable binds; so create and close are cheap directory operations and an exec
is one process spawn. Files persist across execs; processes do not (the pid
namespace dies with the exec). With `prestart` (the default) that bwrap is a
Spare started during the previous exec (or by the provider before create), so
its cgroup join is already done when the command comes (spare.py says why).

Invariants: nothing inside can reach the network (only `lo`); after `close()`
no process of the sandbox is alive and its directory is gone. `close()` is
idempotent and runs on `async with` exit, on cancellation and on Ctrl-C.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from miles_env.errors import SandboxError
from miles_env.sandbox import Command
from miles_env.types import ExecResult, Resources, SandboxSpec

from ..execargs import exec_args, exec_cwd, exec_env
from .cgroup import PidsCgroup
from .paths import safe_read, safe_write, split_inner_path
from .process import RawResult, collect, run_capped
from .spare import Spare, drop_spare, start_spare, trampoline_env

if TYPE_CHECKING:
    from .bridge import Bridge

__all__ = ["LocalSandbox", "classify"]

_MEMORY_HINTS = re.compile(
    rb"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory|memory exhausted"
    rb"|failed to reserve",
    re.IGNORECASE,
)
_FORK_HINTS = re.compile(rb"Cannot fork|fork: (retry|Resource temporarily unavailable)|can't fork")


def classify(raw: RawResult, procs_refused: bool) -> tuple[int, str | None]:
    """Turn bwrap's status into (exit_code, killed_by_limit).

    bwrap reports a command killed by signal N as 128+N; we report -N (and -9
    for our own kills), so callers see signals the way subprocess does.
    """
    code = raw.returncode
    if 128 < code < 160:
        code = -(code - 128)
    if raw.timed_out:
        return code, None
    if raw.output_killed:
        return code, "output"
    if code == -signal.SIGXCPU:
        return code, "cpu"
    if code == -signal.SIGXFSZ:
        return code, "disk"
    if code != 0 and (procs_refused or _FORK_HINTS.search(raw.stderr)):
        return code, "procs"
    if code != 0 and _MEMORY_HINTS.search(raw.stderr):
        return code, "memory"
    return code, None


def _argv_of(cmd: Command) -> list[str]:
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    argv = [str(a) for a in cmd]
    if not argv:
        raise SandboxError("exec: cmd is an empty argv list")
    return argv


class LocalSandbox:
    """A Sandbox (miles_env.sandbox.Sandbox) backed by bubblewrap; built by LocalSandboxProvider."""

    def __init__(
        self,
        *,
        sandbox_id: str,
        spec: SandboxSpec,
        host_dir: Path,
        bwrap_prefix: list[str],
        limit_prefix: list[str],
        cgroup: PidsCgroup | None,
        python: str,
        spare: Spare | None = None,
        prestart: bool = True,
        after_exec: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.id = sandbox_id
        self.workdir = spec.workdir
        self.spec = spec
        self.host_dir = host_dir
        self._bwrap_prefix = bwrap_prefix
        self._limit_prefix = limit_prefix
        self._cgroup = cgroup
        self._python = python
        self._live: set[int] = {spare.pid} if spare is not None else set()
        self._spare = spare
        self._prestart = prestart
        self._after_exec = after_exec  # the provider's warm-pool refill, run while a command runs
        self._closed = False
        self._bridge: Bridge | None = None
        self.mounts = {spec.workdir: str(host_dir / "work"), "/tmp": str(host_dir / "tmp")}
        self.mounts_ro: dict[str, str] = {}  # inner path -> host path, added by mount_ro()

    # -- exec ---------------------------------------------------------------------------
    def _options(self, cwd: str | None, env: Mapping[str, str] | None) -> list[str]:
        """bwrap's options after the binary: namespaces, mounts, env, cwd (no command)."""
        out = self._bwrap_prefix[1:]
        if self._bridge is not None:
            out.append("--share-net")
        for key, value in exec_env(self.spec, self.workdir, env).items():
            out += ["--setenv", key, value]
        return [*out, "--chdir", exec_cwd(self.workdir, cwd)]

    def _outer(self) -> list[str]:
        return self._bridge.nsenter_prefix() if self._bridge is not None else []

    def _argv(self, cmd: Command, cwd: str | None, env: Mapping[str, str] | None) -> list[str]:
        """The whole argv of an exec without a spare: limits wrapper, nsenter, bwrap, its options."""
        return [
            *self._limit_prefix,
            *self._outer(),
            self._bwrap_prefix[0],
            *self._options(cwd, env),
            "--",
            *_argv_of(cmd),
        ]

    async def exec(
        self,
        cmd: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
    ) -> ExecResult:
        self._check_open()
        res: Resources = self.spec.resources
        args = exec_args(self.spec, self.workdir, timeout=timeout, cwd=cwd, env=env, stdin=stdin)
        limit, data = args.timeout, args.stdin
        refused_before = self._cgroup.max_events() if self._cgroup else 0
        if self._prestart:
            command = [*self._options(cwd, env), *trampoline_env(_argv_of(cmd))]
            spare = await self._take_spare()
            try:
                await spare.launch(command, res, nproc=self._cgroup is None)
            except SandboxError:
                await self._drop(spare)
                raise
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._prepare_next)  # overlaps the command, off the caller's path
                raw = await collect(
                    spare.process, stdin=data, timeout=limit, output_cap=res.output_bytes, live=self._live
                )
        else:
            raw = await run_capped(
                self._argv(cmd, cwd, env),
                stdin=data,
                timeout=limit,
                output_cap=res.output_bytes,
                live=self._live,
            )
        return self._result(raw, refused_before)

    def _result(self, raw: RawResult, refused_before: int) -> ExecResult:
        refused = self._cgroup is not None and self._cgroup.max_events() > refused_before
        code, killed_by = classify(raw, refused)
        if raw.timed_out:
            code = -signal.SIGKILL
        return ExecResult(
            exit_code=code,
            stdout=raw.stdout.decode("utf-8", "replace"),
            stderr=raw.stderr.decode("utf-8", "replace"),
            timed_out=raw.timed_out,
            killed_by_limit=killed_by,
            truncated=raw.truncated,
            duration_s=raw.duration_s,
        )

    # -- spares (spare.py) ----------------------------------------------------------------
    async def _take_spare(self) -> Spare:
        spare, self._spare = self._spare, None
        outer = tuple(self._outer())
        if spare is not None and (spare.outer != outer or spare.process.poll() is not None):
            await self._drop(spare)  # made before expose() changed the netns, or died
            spare = None
        if spare is None:
            spare = start_spare(self._bwrap_prefix[0], outer, self._cgroup, self._live)
        return spare

    async def _prepare_next(self) -> None:
        # Shielded: a spare abandoned half-started would leak its process and pipe.
        with anyio.CancelScope(shield=True):
            if not self._closed and self._spare is None:
                spare = start_spare(self._bwrap_prefix[0], self._outer(), self._cgroup, self._live)
                if self._closed or self._spare is not None:  # closed, or a concurrent exec won
                    await self._drop(spare)
                else:
                    self._spare = spare
            if self._after_exec is not None and not self._closed:
                await self._after_exec()

    async def _drop(self, spare: Spare) -> None:
        await drop_spare(spare, self._live)

    # -- files --------------------------------------------------------------------------
    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check_open()
        host, parts = split_inner_path(path, self.workdir, self.mounts)
        safe_write(host, parts, data.encode() if isinstance(data, str) else bytes(data), path)

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        host, parts = split_inner_path(path, self.workdir, self.mounts)
        return safe_read(host, parts, path)

    def mount_ro(self, host_path: str, inner_path: str) -> None:
        """Bind `host_path` read-only at `inner_path` for every later exec (e.g. an agent CLI).

        Why a per-sandbox method and not a spec field: the mount is the harness's need, not
        the task's; the environment's SandboxSpec stays the same whatever harness runs it.
        """
        self._check_open()
        if not os.path.exists(host_path):
            raise SandboxError(f"mount_ro: host path {host_path!r} does not exist")
        if not inner_path.startswith("/") or inner_path.rstrip("/") in (
            "",
            self.workdir,
            "/tmp",
            "/proc",
            "/dev",
        ):
            raise SandboxError(f"mount_ro: inner path {inner_path!r} must be a dedicated absolute path")
        at = self._bwrap_prefix.index("--remount-ro")  # mount points must exist before / turns read-only
        self._bwrap_prefix[at:at] = ["--ro-bind", host_path, inner_path]
        self.mounts_ro[inner_path] = host_path

    # -- network ------------------------------------------------------------------------
    async def expose(self, url: str) -> str:
        self._check_open()
        if self._bridge is None:
            from .bridge import Bridge

            self._bridge = Bridge(self.host_dir / "run", self._bwrap_prefix, self._limit_prefix, self._python)
        return await self._bridge.expose(url, self._live)

    # -- lifecycle ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            self._kill_everything()
            if self._spare is not None:
                spare, self._spare = self._spare, None
                await self._drop(spare)  # reaped, so the cgroup is empty for rmdir
            if self._bridge is not None:
                await self._bridge.aclose()
            self._kill_everything()
            if self._cgroup is not None:
                self._cgroup.remove()
            shutil.rmtree(self.host_dir, ignore_errors=True)

    def _kill_everything(self) -> None:
        for pid in list(self._live):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._cgroup is not None:
            self._cgroup.kill_all()

    async def __aenter__(self) -> LocalSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"LocalSandbox(id={self.id!r}, workdir={self.workdir!r}, closed={self._closed})"
