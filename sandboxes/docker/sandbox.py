"""DockerSandbox: one container of DockerSandboxProvider's, used through the Sandbox contract.

Exec: each exec is a Docker exec (as the image's USER, in its WORKDIR unless the call
says otherwise, with the image's ENV under the call's: execargs.py) whose wrapper shell
sets the same rlimits as the local provider (so results.py's classification applies)
and carries a unique `MILES_EXEC` token in its environment; a timeout, an output flood or a
cancellation kills every process carrying that token, which is the exec's whole
process tree (exec.py). Files go through the engine's archive API (files.py). When the
provider's disk watchdog killed the container (its writable layer passed disk_mb:
watchdog.py), the ongoing exec and every later call raise that one-line SandboxError.

expose() needs the engine on this host: the sandbox's host run dir is bind-mounted
read-only at INNER_RUN and expose.py's forwarder and HostListener carry the bytes;
with `expose_url` set (a remote engine) it returns that URL instead.

Lifecycle: built by the provider's create(); close() (idempotent, shielded)
removes the container and its volume and deletes the run dir.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import anyio
import docker.errors

from miles_env.errors import SandboxError
from miles_env.sandbox import Command
from miles_env.types import ExecResult, SandboxSpec

from ..execargs import command_argv, exec_args
from ..expose import INNER_RUN, ExposeTarget, HostListener
from ..images.oci import ImageConfig
from ..images.resolve import ResolvedImage
from ..results import classify
from .engine import ENGINE_ERRORS, map_error
from .exec import ExecOutcome, kill_token_argv, run_exec, start_detached
from .files import ContainerFiles

if TYPE_CHECKING:
    from .build import DockerBuilder
    from .config import DockerSandboxConfig
    from .watchdog import DiskWatchdog

__all__ = ["ContainerOwner", "DockerSandbox"]

_NO_SUCH_USER = (b"unable to find user ", b"unable to find group ")  # runc's, on an exec's `-u`


class ContainerOwner(Protocol):
    """What a DockerSandbox needs of the provider that built it (DockerSandboxProvider is one)."""

    client: docker.DockerClient
    config: DockerSandboxConfig
    builder: DockerBuilder
    watchdog: DiskWatchdog

    def remove_sync(self, name: str) -> None: ...


class DockerSandbox:
    """A Sandbox backed by one container; built by DockerSandboxProvider."""

    image_bases: tuple[ResolvedImage, ...] = ()  # set by the provider for a built image (build.py)

    def __init__(
        self,
        provider: ContainerOwner,
        cid: str,
        name: str,
        spec: SandboxSpec,
        run_dir: Path,
        image: ImageConfig | None = None,
    ) -> None:
        self.id = name
        self.image_config = image or ImageConfig()  # the image's ENV, USER, WORKDIR, which every exec gets
        self.container_id = cid
        self.workdir = spec.workdir
        self.spec = spec
        # The build context this container's image was built from (SandboxSpec.build), if any.
        self.built_from = spec.build if spec.image is None and spec.rootfs is None else None
        self.run_dir = run_dir
        self._provider = provider
        self._api = provider.client.api
        self._closed = False
        self._sidecars: list[str] = []  # container ids (sidecars.py), removed before ours
        self._listeners: list[HostListener] = []
        self._forwarders: list[socket.socket] = []
        self._expose_lock = anyio.Lock()
        self._files = ContainerFiles(
            self._api, cid, name, spec.workdir, provider.config.max_read_bytes, self._run, self._explain
        )

    # -- exec ---------------------------------------------------------------------------
    def _wrap(self, cmd: Command) -> list[str]:
        argv = command_argv(cmd)
        r = self.spec.resources
        limits = (
            f"ulimit -S -t {r.cpu_seconds} && ulimit -H -t {r.cpu_seconds + 1} && ulimit -v {r.memory_mb << 10}"
            f' && ulimit -f {r.disk_mb << 11} && ulimit -c 0 || exit 125; exec "$@"'
        )
        return ["/bin/sh", "-c", limits, "sh", *argv]

    async def _run(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        stdin: bytes | None,
        timeout: float,
        cap: int,
        user: str = "",
    ) -> ExecOutcome:
        self._check_open()
        token = secrets.token_hex(8)
        full_env = {**env, "MILES_EXEC": token}
        stop = threading.Event()
        outcome: ExecOutcome | None = None

        def work() -> ExecOutcome:
            return run_exec(
                self._api, self.container_id, argv, full_env, cwd, stdin, timeout, cap, token, stop, user=user
            )

        try:
            outcome = await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        except ENGINE_ERRORS as e:
            raise await self._explain(e, "exec") from e
        finally:
            if outcome is None:  # cancelled or failed: make sure nothing of it keeps running
                stop.set()
                with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                    await self._kill_token(token, user)
        self._check_quota()  # the watchdog ended it: the exit code is its SIGKILL, not the command's
        return outcome

    async def _kill_token(self, token: str, user: str = "") -> None:
        """SIGKILL the exec's processes, by an exec as its user (who may read their environ)."""

        def kill() -> None:
            eid = self._api.exec_create(self.container_id, kill_token_argv(token), user=user)["Id"]
            self._api.exec_start(eid)

        try:
            await anyio.to_thread.run_sync(kill)
        except Exception:  # noqa: BLE001 - container gone: nothing left to kill
            pass

    async def _explain(self, e: BaseException, what: str) -> SandboxError:
        """Map an engine error, naming the container's state when it stopped or vanished."""
        why = self._provider.watchdog.verdict(self.container_id)
        if why is not None:
            return SandboxError(f"sandbox {self.id}: {what}: {why}")
        try:
            state = await anyio.to_thread.run_sync(
                lambda: self._api.inspect_container(self.container_id)["State"]
            )
            if not state.get("Running"):
                return SandboxError(
                    f"sandbox {self.id}: {what}: the container is {state.get('Status')} "
                    f"(exit {state.get('ExitCode')}, OOMKilled={state.get('OOMKilled')})"
                )
        except docker.errors.NotFound:
            return SandboxError(f"sandbox {self.id}: {what}: the container disappeared")
        except Exception:  # noqa: BLE001 - fall back to the original error
            pass
        return map_error(e, f"sandbox {self.id}: {what}")

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
        res = self.spec.resources
        # No HOME: the engine sets the exec user's passwd home itself, as `docker exec` does.
        # `user` is `docker exec -u`: the engine looks it up in the container's /etc/passwd.
        args = exec_args(
            self.spec, self.workdir, timeout=timeout, cwd=cwd, env=env, stdin=stdin, image=self.image_config
        )
        out = await self._run(
            self._wrap(cmd),
            env=args.env,
            cwd=args.cwd,
            stdin=args.stdin,
            timeout=args.timeout,
            cap=res.output_bytes,
            user=user or "",
        )
        if user and out.raw.returncode == 126 and out.raw.stdout.startswith(_NO_SUCH_USER):
            # runc's lookup failed before the command ran (`docker exec -u` prints it, exits 126)
            why = out.raw.stdout.decode("utf-8", "replace").splitlines()[0]
            raise SandboxError(f"sandbox {self.id}: exec user {user!r}: {why}")
        code, killed_by = classify(out.raw, procs_refused=False)
        if out.raw.timed_out:
            code = -9
        return ExecResult(
            exit_code=code,
            stdout=out.raw.stdout.decode("utf-8", "replace"),
            stderr=out.raw.stderr.decode("utf-8", "replace"),
            timed_out=out.raw.timed_out,
            killed_by_limit=killed_by,
            truncated=out.raw.truncated,
            duration_s=out.raw.duration_s,
        )

    # -- files (files.py) ----------------------------------------------------------------
    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check_open()
        await self._files.write(path, data)

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        return await self._files.read(path)

    # -- network ------------------------------------------------------------------------
    async def expose(self, url: str) -> str:
        self._check_open()
        target = ExposeTarget.parse(url)
        if self._provider.config.expose_url:
            return self._provider.config.expose_url.rstrip("/") + target.tail
        async with self._expose_lock:
            n = len(self._listeners)
            self._listeners.append(
                HostListener(str(self.run_dir / f"expose-{n}.sock"), (target.host, target.port))
            )
            inner_port = 20000 + n
            argv = [
                "python3",
                "-u",
                f"{INNER_RUN}/forwarder.py",
                str(inner_port),
                f"{INNER_RUN}/expose-{n}.sock",
            ]
            try:
                sock = await anyio.to_thread.run_sync(
                    start_detached, self._api, self.container_id, argv, b"READY", 20.0
                )
            except ENGINE_ERRORS as e:
                raise await self._explain(e, "expose") from e
            self._forwarders.append(sock)
        return f"{target.scheme}://127.0.0.1:{inner_port}{target.tail}"

    # -- lifecycle ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        self._check_quota()

    def _check_quota(self) -> None:
        why = self._provider.watchdog.verdict(self.container_id)
        if why is not None:
            raise SandboxError(f"sandbox {self.id}: {why}")

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
        """RunsSidecars: a container in this one's network namespace, `name` resolving to it here."""
        from .sidecars import run_sidecar, wait_sidecar

        def start() -> str:
            return run_sidecar(
                self._provider.client, self._provider.builder, self.container_id, name, image=image,
                build=build, dockerfile=dockerfile, env=env or {}, command=command,
            )  # fmt: skip

        cid = await anyio.to_thread.run_sync(start)
        self._sidecars.append(cid)  # before the wait: one that never gets healthy is removed at close
        # Its own layer is never capped by the engine (no storage_opt): bounded as ours would be.
        self._provider.watchdog.watch(cid, self.spec.resources.disk_mb, owner=self.container_id)
        await wait_sidecar(self._api, cid, name, healthcheck, timeout)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for s in self._forwarders:
                s.close()
            for listener in self._listeners:
                listener.close()
            for cid in (*self._sidecars, self.container_id):
                self._provider.watchdog.unwatch(cid)
            for cid in self._sidecars:
                try:
                    await anyio.to_thread.run_sync(self._provider.remove_sync, cid)
                except Exception:  # noqa: BLE001 - the reaper removes it by its labels
                    pass
            try:
                await anyio.to_thread.run_sync(self._provider.remove_sync, self.id)
            except Exception as e:  # noqa: BLE001
                raise map_error(e, f"sandbox {self.id}: close (the reaper will retry)") from e
            finally:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    async def __aenter__(self) -> DockerSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"DockerSandbox(id={self.id!r}, closed={self._closed})"
