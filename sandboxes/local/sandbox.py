"""The local sandbox: one bubblewrap invocation per exec over a persistent private directory.

Concept: a sandbox is a writable tree on the host (storage.py: workspace bound at
spec.workdir, a private /tmp and /dev/shm; as root one size-capped tmpfs owned by
the sandbox's own unprivileged uid) plus, when the host allows it, a pids cgroup.
Each exec is a single fresh `bwrap --unshare-all` (new user, mount, pid, net, ipc,
uts, cgroup namespaces, no capabilities) that sees only the read-only system dirs
and those writable binds; so create and close are cheap directory (and mount)
operations and an exec is one process spawn. Files persist across execs;
processes do not (the pid namespace dies with the exec). With a pids cgroup, that bwrap is forked by the
sandbox's zygote, which already lives in the cgroup, so no exec has to join it
(zygote.py says why that matters); the provider recycles zygote and cgroup.

Invariants: nothing inside can reach the network (only `lo`); as root, nothing
inside runs as host root or holds a capability; after `close()` no process of
the sandbox is alive and its files and mount are gone. `close()` is
idempotent and runs on `async with` exit, on cancellation and on Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import anyio

from miles_env.errors import SandboxError
from miles_env.sandbox import Command
from miles_env.types import ExecResult, Resources, SandboxSpec

from ..execargs import command_argv, exec_args, exec_cwd, exec_env
from ..images.oci import ImageConfig
from ..images.resolve import ResolvedImage
from ..results import RawResult, classify
from .cgroup import PidsCgroup
from .forkserver import RequestTooLarge, Zygote
from .paths import safe_read, safe_write, split_inner_path
from .process import collect, run_capped
from .storage import Storage

if TYPE_CHECKING:
    from .bridge import Bridge

__all__ = ["LocalSandbox"]


class LocalSandbox:
    """A Sandbox (miles_env.sandbox.Sandbox) backed by bubblewrap; built by LocalSandboxProvider."""

    # Set by the provider when the sandbox's root is a task image (sandboxes/images/local.py).
    image_config: ImageConfig | None = None
    image_bases: tuple[ResolvedImage, ...] = ()

    def __init__(
        self,
        *,
        sandbox_id: str,
        spec: SandboxSpec,
        storage: Storage,
        bwrap_prefix: list[str],
        limit_prefix: list[str],
        drop_prefix: list[str],
        cgroup: PidsCgroup | None,
        python: str,
        max_read_bytes: int,
        zygote: Zygote | None = None,
        on_close: Callable[[Zygote, PidsCgroup], None] | None = None,
    ) -> None:
        self.id = sandbox_id
        self.workdir = spec.workdir
        self.spec = spec
        self.storage = storage
        self.host_dir = storage.host_dir  # bookkeeping (owner.json); the files are under storage.base
        self._bwrap_prefix = bwrap_prefix
        self._limit_prefix = limit_prefix
        self._drop_prefix = drop_prefix  # as root: become the sandbox's uid before bwrap
        self._max_read_bytes = max_read_bytes
        self._cgroup = cgroup
        self._python = python
        self._live: set[int] = set()
        self._zygote = zygote
        self._on_close = on_close  # hands zygote + cgroup back to the provider for reuse
        self._closed = False
        self._bridge: Bridge | None = None
        self.mounts = {spec.workdir: str(storage.path("work")), "/tmp": str(storage.path("tmp"))}
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

    def _netns(self) -> str | None:
        return self._bridge.netns() if self._bridge is not None else None

    def _bwrap_argv(self, cmd: Command, cwd: str | None, env: Mapping[str, str] | None) -> list[str]:
        """bwrap, its options, `--`, the command."""
        return [self._bwrap_prefix[0], *self._options(cwd, env), "--", *command_argv(cmd)]

    def _argv(self, cmd: Command, cwd: str | None, env: Mapping[str, str] | None) -> list[str]:
        """The argv of a process we start ourselves: the limits wrapper (joins the cgroup), nsenter
        (after expose(); needs root, so before) the drop to the sandbox's uid, then bwrap."""
        outer = ["nsenter", f"--net={netns}", "--"] if (netns := self._netns()) else []
        return [*self._limit_prefix, *outer, *self._drop_prefix, *self._bwrap_argv(cmd, cwd, env)]

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
        child = None
        if self._zygote is not None:
            start = time.perf_counter()
            try:
                argv = self._bwrap_argv(cmd, cwd, env)
                child = self._zygote.spawn(argv, res, netns=self._netns(), ids=self.storage.ids)
            except RequestTooLarge:
                child = None  # a huge command line: started by us, joining the cgroup itself (below)
        if child is not None and self._zygote is not None:
            raw = await collect(child, stdin=data, timeout=limit, output_cap=res.output_bytes, start=start)
            if child.sandbox_pid is None and not raw.stderr and self._zygote.process.poll() is not None:
                raise SandboxError(f"exec: the sandbox's zygote (pid {self._zygote.pid}) died")
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

    # -- files --------------------------------------------------------------------------
    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check_open()
        host, parts = split_inner_path(path, self.workdir, self.mounts)
        payload = data.encode() if isinstance(data, str) else bytes(data)
        safe_write(host, parts, payload, path, owner=self.storage.ids)

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        host, parts = split_inner_path(path, self.workdir, self.mounts)
        return safe_read(host, parts, path, self._max_read_bytes)

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
        self._bwrap_prefix[at:at] = ["--ro-bind", self.storage.reachable(host_path), inner_path]
        self.mounts_ro[inner_path] = host_path

    # -- network ------------------------------------------------------------------------
    async def expose(self, url: str) -> str:
        self._check_open()
        if self._bridge is None:
            from .bridge import Bridge

            self._bridge = Bridge(
                self.storage.path("run"),
                self._bwrap_prefix,
                self._limit_prefix,
                self._drop_prefix,
                self._python,
            )
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
            if self._bridge is not None:
                await self._bridge.aclose()
            self._kill_everything()
            if self._zygote is not None and self._cgroup is not None and self._on_close is not None:
                if await self._empty_but_zygote(self._zygote, self._cgroup):
                    self._on_close(self._zygote, self._cgroup)
                else:
                    self._zygote.close()
                    self._cgroup.remove()
            elif self._cgroup is not None:
                self._cgroup.remove()
            self.storage.remove()

    @staticmethod
    async def _empty_but_zygote(zygote: Zygote, cgroup: PidsCgroup, deadline_s: float = 5.0) -> bool:
        """Kill whatever is left in the cgroup except the zygote, until it is the only member."""
        end, pause = time.monotonic() + deadline_s, 0.0001
        while time.monotonic() < end:
            left = [p for p in cgroup.pids() if p != zygote.pid]
            if not left:
                return zygote.process.poll() is None
            for pid in left:  # often just an exec's bwrap that is still finishing its exit
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            await anyio.sleep(pause)
            pause = min(pause * 2, 0.01)
        return False

    def _kill_everything(self) -> None:
        for pid in list(self._live):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._cgroup is not None and self._zygote is None:
            self._cgroup.kill_all()

    async def __aenter__(self) -> LocalSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"LocalSandbox(id={self.id!r}, workdir={self.workdir!r}, closed={self._closed})"
