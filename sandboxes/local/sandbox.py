"""The local sandbox: one process space and one writable root for its whole life, like a container.

Concept: a sandbox is a long-lived set of namespaces (user, mount, pid, net, ipc, uts, cgroup)
made by one bwrap at create and held by its zygote (zygote.py), over a writable tree on the host
(storage.py: as root one size-capped tmpfs owned by the sandbox's own unprivileged host uids;
layout.py: the writable root, workspace, /tmp). Each exec is a fork of the zygote that enters
those namespaces and runs the command inside: so a process an exec leaves running (a server)
is still there for the next exec and the verifier, a port bound in one exec answers the next
(one network namespace: only `lo`, and with network `public` slirp4netns's `eth0`), and files
persist. The image's environment applies to every exec unless the caller sets a key
(execargs.py): its ENV and PATH, its user (users.py) and that user's HOME, its WORKDIR as the
default cwd. Compose sidecars (sidecars.py) are sandboxes of their own in this one's network
namespace, closed before it.

Invariants: nothing inside reaches the network unless the spec asks for `public`: then outbound
TCP/UDP/DNS through slirp4netns, never the host's loopback (network.py); either way the host's
127.0.0.1 services only through what expose() bridges. As
root, nothing inside runs as host root or holds a capability; after `close()` no process of the
sandbox is alive (its init, pid 1 of its pid namespace, exits and the kernel kills the rest; the
zygote checks that its cgroup holds only itself and the next init before it is reused) and its files and mounts are gone. `close()` is
idempotent and runs on `async with` exit, on cancellation and on Ctrl-C. If the owner dies
(SIGKILL included), the zygote sees EOF and stops the sandbox; if the zygote dies, the init sees
EOF on its pipe and exits, which kills the pid namespace, and slirp4netns sees EOF on its exit fd:
nothing of a killed run survives it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping

import anyio

from miles_env.errors import ConfigError, SandboxError
from miles_env.sandbox import Command
from miles_env.types import ExecResult, SandboxSpec

from ..execargs import command_argv, exec_args
from ..images.oci import ImageConfig
from ..images.resolve import ResolvedImage
from ..results import RawResult, classify
from .bridge import Bridge
from .cgroup import PidsCgroup
from .forkserver import Zygote, ZygoteChild, all_pids, rlimits
from .paths import safe_read, safe_write, split_inner_path
from .process import collect
from .sidecars import Sidecar, add_host, share_owner, sidecar_spec
from .storage import Storage
from .users import ExecUser, exec_user

__all__ = ["LocalSandbox"]


class LocalSandbox:
    """A Sandbox (miles_env.sandbox.Sandbox) backed by bubblewrap; built by LocalSandboxProvider."""

    # Set by the provider when the sandbox's root is a task image it built (sandboxes/images/local.py).
    image_bases: tuple[ResolvedImage, ...] = ()

    def __init__(
        self,
        *,
        sandbox_id: str,
        spec: SandboxSpec,
        storage: Storage,
        zygote: Zygote,
        cgroup: PidsCgroup | None,
        max_read_bytes: int,
        image: ImageConfig | None = None,
        user: ExecUser | None = None,
        on_close: Callable[[Zygote, PidsCgroup | None, bool], None] | None = None,
        init_pid: int = 0,
        make_sidecar: Callable[[SandboxSpec, Zygote], Awaitable[LocalSandbox]] | None = None,
    ) -> None:
        self.id = sandbox_id
        self.workdir = spec.workdir
        self.spec = spec
        self.storage = storage
        self.host_dir = storage.host_dir  # bookkeeping (owner.json); the files are under storage.base
        self.image_config = image  # None: the host's view (no image); else the image's ENV, USER, WORKDIR
        self.user = user or ExecUser(0, 0, (0,), spec.workdir, "root")
        self._max_read_bytes = max_read_bytes
        self._cgroup = cgroup
        self._zygote = zygote
        self._on_close = on_close  # hands zygote + cgroup back to the provider
        self._closed = False
        self._pending_mounts: list[tuple[str, str]] = []
        self._bridge: Bridge | None = None  # made by the first expose()
        self._make_sidecar = make_sidecar  # the provider's: a sandbox in our network namespace
        self._sidecars: list[Sidecar] = []  # closed before us
        self.init_pid = init_pid  # host pid of the sandbox's init (pid 1 inside)
        self.mounts = {spec.workdir: str(storage.path("work")), "/tmp": str(storage.path("tmp"))}
        self.mounts_ro: dict[str, str] = {}  # inner path -> host path, added by mount_ro()

    # -- exec ---------------------------------------------------------------------------
    def _members(self) -> list[int]:
        """Host pids that may belong to this sandbox: its cgroup's, or (without one) every pid."""
        return self._cgroup.pids() if self._cgroup is not None else all_pids()

    def start_child(
        self,
        cmd: Command,
        *,
        cwd: str | None,
        env: Mapping[str, str] | None,
        timeout: float | None = None,
        user: str | None = None,
    ) -> tuple[ZygoteChild, float]:
        """Start `cmd` in the sandbox (exec's and spawn's first half); the child and its time limit."""
        who = self.user if user is None else self._exec_user(user)
        home = who.home if self.image_config is not None else None
        args = exec_args(
            self.spec,
            self.workdir,
            timeout=timeout,
            cwd=cwd,
            env=env,
            stdin=None,
            image=self.image_config,
            home=home,
        )
        child = self._zygote.spawn(
            command_argv(cmd),
            env=args.env,
            cwd=args.cwd,
            ids=(who.uid, who.gid, who.groups),
            limits=rlimits(self.spec.resources, nproc=self._cgroup is None, fsize=not self.storage.mounted),
            members=self._members,
        )
        return child, args.timeout

    def _exec_user(self, user: str) -> ExecUser:
        """`user` looked up in the image's files (the lower layer, which nothing inside can change)."""
        try:
            return exec_user(self.spec.rootfs, user, self._zygote.ids[1])
        except ConfigError as e:
            raise SandboxError(f"sandbox {self.id}: {e}") from e

    async def exec(
        self,
        cmd: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        user: str | None = None,
    ) -> ExecResult:
        self._check_open()
        await self._apply_mounts()
        start = time.perf_counter()
        refused_before = self._cgroup.max_events() if self._cgroup else 0
        child, limit = self.start_child(cmd, cwd=cwd, env=env, timeout=timeout, user=user)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        raw = await collect(
            child, stdin=data, timeout=limit, output_cap=self.spec.resources.output_bytes, start=start
        )
        if child.error is not None:
            raise SandboxError(f"sandbox {self.id}: exec: {child.error}")
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
        """Bind `host_path` read-only at `inner_path`, for the next exec on (e.g. an agent CLI).

        Why a per-sandbox method and not a spec field: the mount is the harness's need, not
        the task's; the environment's SandboxSpec stays the same whatever harness runs it.
        The zygote attaches it before the next exec, spawn or expose (this call stays sync).
        """
        self._check_open()
        if not os.path.exists(host_path):
            raise SandboxError(f"mount_ro: host path {host_path!r} does not exist")
        bad = ("", self.workdir.rstrip("/"), "/tmp", "/proc", "/dev")
        if not inner_path.startswith("/") or inner_path.rstrip("/") in bad:
            raise SandboxError(f"mount_ro: inner path {inner_path!r} must be a dedicated absolute path")
        self._pending_mounts.append((host_path, inner_path))
        self.mounts_ro[inner_path] = host_path

    async def _apply_mounts(self) -> None:
        while self._pending_mounts:
            host_path, inner_path = self._pending_mounts.pop(0)
            await self._zygote.mount(host_path, inner_path)

    # -- network ------------------------------------------------------------------------
    async def expose(self, url: str) -> str:
        self._check_open()
        await self._apply_mounts()
        self._bridge = self._bridge or Bridge(self._zygote)
        return await self._bridge.expose(url)

    # -- sidecars -----------------------------------------------------------------------
    async def start_sidecar(
        self,
        name: str,
        *,
        image: str | None = None,
        build: str | None = None,
        dockerfile: str | None = None,
        env: Mapping[str, str] | None = None,
        command: list[str] | str | None = None,
        healthcheck: list[str] | str | None = None,
        timeout: float = 120.0,
    ) -> None:
        """RunsSidecars: a sandbox of its own image in our network namespace, `name` resolving to
        it here; returns once it is healthy (sidecars.py)."""
        self._check_open()
        if self._make_sidecar is None:
            raise SandboxError(f"sandbox {self.id}: made without a provider that runs sidecars")
        spec = sidecar_spec(self.spec, name, image, build, dockerfile, env)
        sandbox = await self._make_sidecar(spec, self._zygote)
        try:
            sidecar = Sidecar.start(name, sandbox, command)
        except BaseException:
            await sandbox.close()
            raise
        self._sidecars.append(sidecar)  # before the wait: one that never gets healthy goes at close
        share_owner(self.host_dir, sandbox.host_dir)
        add_host(self.storage.path("run", "hosts"), name)
        add_host(sandbox.storage.path("run", "hosts"), name)
        await sidecar.wait_healthy(healthcheck, timeout)

    # -- lifecycle ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            failed: list[Exception] = []
            for sidecar in self._sidecars:  # first, as docker removes them before the task container
                try:
                    await sidecar.close()
                except Exception as e:  # noqa: BLE001 - re-raised once we are closed too
                    failed.append(e)
            stopped = False
            with anyio.move_on_after(20):
                stopped = await self._stop()
            if self._bridge is not None:
                self._bridge.close()
            if self._on_close is not None:
                self._on_close(self._zygote, self._cgroup, stopped)
            self.storage.remove()
            if failed:
                raise failed[0]

    async def _stop(self) -> bool:
        """Have the zygote end the sandbox; True once its init is gone and the zygote was left alone
        in its cgroup (it checks that itself before it answers, then makes the next init)."""
        try:
            return await self._zygote.stop() and self._zygote.process.poll() is None
        except SandboxError:
            return False

    async def __aenter__(self) -> LocalSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"LocalSandbox(id={self.id!r}, workdir={self.workdir!r}, closed={self._closed})"
