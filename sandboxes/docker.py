"""The docker provider ("docker"): one container per sandbox on any Docker-API engine.

Concept: a sandbox is a container made from `spec.image` (or a local rootfs
imported once as an image), kept alive by `sleep infinity` under docker-init,
with a read-only root, a named volume at spec.workdir, a tmpfs /tmp, no network
(`network_mode=none`), and memory, CPU and pids limits.

Privilege: never privileged; every capability dropped (none is added back: the
exec wrapper, the kill-by-token sweep and file I/O as the container's root need
none, while CHOWN, DAC_OVERRIDE, FOWNER, MKNOD, SETUID... would let a command make
device nodes or take over files it does not own); no-new-privileges, so a setuid
file gains nothing. The workspace volume is a tmpfs of the local driver (`size` =
disk_mb, capped inodes, nosuid,nodev: a setuid-root file made there never acts as
one on the host), /tmp and /dev/shm are tmpfs of at most disk_mb and 64 MB each.
The container's root is still host uid 0 unless the engine remaps users
(dockerd --userns-remap); that is the engine's configuration, not ours. Each exec is a Docker
exec whose wrapper shell sets the same rlimits as the local provider (so the
same limit classification applies) and carries a unique `MILES_EXEC` token in
its environment; a timeout, an output flood or a cancellation kills every
process carrying that token, which is the exec's whole process tree.

Ownership: every container and volume carries labels (managed, run id, owner
host, pid and pid start time, created-at, TTL, host run dir), so
`reap()` can remove what a crashed run left behind. expose() needs the engine on
this host: the sandbox's host run dir is bind-mounted read-only at
/run/miles-env and the local provider's forwarder/host bridge carry the bytes.

Lifecycle: create -> exec/files/expose -> close (container and volume removed,
run dir deleted); create cleans up after itself when it fails or is cancelled.
The SDK is synchronous: every call runs in a worker thread. Exec plumbing lives in
_docker_exec.py, file I/O (archive API, read cap, seeding the volume) in _docker_files.py.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import shutil
import socket
import tarfile
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import docker
import docker.errors
import requests.exceptions
from pydantic import BaseModel, ConfigDict, Field

from miles_env.errors import ConfigError, SandboxError, SandboxUnavailable
from miles_env.sandbox import Command
from miles_env.types import ExecResult, NetworkPolicy, SandboxSpec

from ._docker_exec import ExecOutcome, kill_token_argv, run_exec
from ._docker_files import ContainerFiles, workdir_seed
from .execargs import exec_args
from .local.bridge import _FORWARDER, _HostListener
from .local.sandbox import classify
from .ownership import Ownership, owner_labels

__all__ = ["DockerSandboxConfig", "DockerSandboxProvider", "DockerSandbox", "DEFAULT_IMAGE"]

DEFAULT_IMAGE = "miles-env/hostroot:latest"
_INNER_RUN = "/run/miles-env"
T = TypeVar("T")


class DockerSandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str | None = Field(None, description="engine URL; None = DOCKER_HOST or the default socket")
    image: str = Field(DEFAULT_IMAGE, description="image used when SandboxSpec.image is None")
    cpus: float = Field(1.0, gt=0, description="CPU quota per sandbox")
    tmp_mb: int = Field(256, gt=0, description="size of the tmpfs at /tmp")
    run_root: str | None = Field(
        None, description="host dir for expose() sockets; None = <tmp>/miles-env-docker"
    )
    run_id: str | None = Field(None, description="ownership label; None = $MILES_ENV_RUN_ID or random")
    ttl_s: float = Field(6 * 3600, gt=0, description="age after which the reaper may remove a sandbox")
    api_timeout_s: float = Field(60.0, gt=0, description="per engine API call")
    expose_url: str | None = Field(
        None, description="public URL of the proxy to return from expose() (remote engines)"
    )
    max_read_bytes: int = Field(
        64 << 20, gt=0, description="largest file read_file() returns; a larger one is a SandboxError"
    )


def _map(e: BaseException, what: str) -> SandboxError:
    if isinstance(e, SandboxError):
        return e
    if isinstance(e, docker.errors.NotFound):
        return SandboxError(f"{what}: not found on the engine ({e.explanation or e})")
    if isinstance(e, docker.errors.APIError):
        return SandboxError(f"{what}: engine refused: {e.explanation or e}")
    if isinstance(e, requests.exceptions.RequestException | OSError):
        return SandboxError(f"{what}: engine unreachable: {e}")
    return SandboxError(f"{what}: {type(e).__name__}: {e}")


async def _call(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as e:
        raise _map(e, what) from e


class DockerSandboxProvider:
    """SandboxProvider "docker"."""

    name = "docker"

    def __init__(self, config: DockerSandboxConfig | None = None) -> None:
        self.config = config or DockerSandboxConfig()
        try:
            self.client = docker.DockerClient(
                base_url=self.config.base_url
                or os.environ.get("DOCKER_HOST")
                or "unix:///var/run/docker.sock",
                timeout=int(self.config.api_timeout_s),
            )
        except docker.errors.DockerException as e:
            raise SandboxUnavailable(f"docker: cannot configure a client: {e}") from e
        self.owner = Ownership.here(self.config.run_id, self.config.ttl_s)
        self._seeds: dict[tuple[str, str], bytes] = {}  # (image id, workdir) -> _workdir_seed()
        self.run_root = Path(self.config.run_root or Path(tempfile.gettempdir()) / "miles-env-docker")

    async def ping(self) -> None:
        try:
            await _call("docker ping", self.client.ping)
        except SandboxError as e:
            raise SandboxUnavailable(f"no Docker engine answers: {e}") from e

    def _validate(self, spec: SandboxSpec) -> None:
        if not spec.workdir.startswith("/") or spec.workdir.rstrip("/") in (
            "",
            "/tmp",
            "/proc",
            "/dev",
            "/run",
        ):
            raise ConfigError(
                f"SandboxSpec.workdir={spec.workdir!r}: must be an absolute, dedicated directory"
            )
        if spec.rootfs is not None and not os.path.isdir(spec.rootfs):
            raise ConfigError(f"SandboxSpec.rootfs={spec.rootfs!r}: not a directory on the host")

    def _image_sync(self, spec: SandboxSpec) -> str:
        if spec.rootfs is None:
            if spec.image is None and spec.build is not None:
                return self._build_sync(Path(spec.build))
            return spec.image or self.config.image
        # A local rootfs becomes an image once (tag = hash of its real path).
        real = os.path.realpath(spec.rootfs)
        tag = "miles-env/rootfs:" + hashlib.sha1(real.encode()).hexdigest()[:12]
        try:
            self.client.images.get(tag)
        except docker.errors.ImageNotFound:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(real, arcname=".")
            self.client.api.import_image_from_data(
                buf.getvalue(), repository=tag.split(":")[0], tag=tag.split(":")[1]
            )
        return tag

    def _build_sync(self, context: Path) -> str:
        """`docker build` of `context`, offline (no pull, no network), once per content hash."""
        h = hashlib.sha256()
        for p in sorted(context.rglob("*")):
            if p.is_file():
                h.update(str(p.relative_to(context)).encode() + b"\0" + p.read_bytes() + b"\0")
        tag = f"miles-env/build:{h.hexdigest()[:16]}"
        try:
            self.client.images.get(tag)
            return tag
        except docker.errors.ImageNotFound:
            pass
        try:
            self.client.images.build(
                path=str(context), tag=tag, pull=False, network_mode="none", rm=True, forcerm=True
            )
        except docker.errors.BuildError as e:
            log = "".join(str(x.get("stream", x.get("error", ""))) for x in e.build_log)[-1500:]
            raise SandboxError(f"docker build of {context / 'Dockerfile'} failed: {e}\n{log}") from e
        except docker.errors.APIError as e:
            raise SandboxError(f"docker build of {context / 'Dockerfile'} failed: {e}") from e
        return tag

    def _create_sync(self, spec: SandboxSpec, name: str, run_dir: Path, labels: dict[str, str]) -> Any:
        res = spec.resources
        image = self._image_sync(spec)
        # A tmpfs of the local driver: the quota and nosuid,nodev hold on the host side too.
        inodes = max(1024, res.disk_mb * 128)
        opts = f"size={res.disk_mb}m,nr_inodes={inodes},nosuid,nodev,mode=0755"
        self.client.volumes.create(
            name=name,
            labels=labels,
            driver="local",
            driver_opts={"type": "tmpfs", "device": "tmpfs", "o": opts},
        )
        tmp_mb = min(self.config.tmp_mb, res.disk_mb)
        container = self.client.containers.create(
            image,
            command=["sleep", "infinity"],
            name=name,
            labels=labels,
            hostname="sandbox",
            init=True,
            network_mode="none" if spec.network is NetworkPolicy.NONE else "host",
            read_only=True,
            mem_limit=f"{res.memory_mb}m",
            memswap_limit=f"{res.memory_mb}m",
            nano_cpus=int(self.config.cpus * 1e9),
            pids_limit=res.max_procs,
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={tmp_mb}m,nr_inodes={inodes},mode=1777"},
            shm_size=f"{min(64, res.disk_mb)}m",
            volumes={
                name: {"bind": spec.workdir, "mode": "rw"},
                str(run_dir): {"bind": _INNER_RUN, "mode": "ro"},
            },
            working_dir=spec.workdir,
            privileged=False,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
        )
        key = (container.attrs["Image"], spec.workdir)
        if key not in self._seeds:  # read once per image: see _docker_files.py
            self._seeds[key] = workdir_seed(self.client.api, key[0], spec.workdir, res.disk_mb, labels)
        seed = self._seeds[key]
        container.start()
        if seed:
            self.client.api.put_archive(container.id, spec.workdir, seed)
        return container

    def _remove_sync(self, name: str) -> None:
        """Remove container and volume `name`; absent ones are fine."""
        try:
            self.client.api.remove_container(name, force=True, v=True)
        except docker.errors.NotFound:
            pass
        try:
            self.client.api.remove_volume(name, force=True)
        except docker.errors.NotFound:
            pass

    async def create(self, spec: SandboxSpec) -> DockerSandbox:
        if not isinstance(spec, SandboxSpec):
            raise ConfigError(f"create(spec): expected a SandboxSpec, got {type(spec).__name__}")
        self._validate(spec)
        sid = secrets.token_hex(6)
        name = f"miles-env-{sid}"
        run_dir = self.run_root / sid
        labels = owner_labels(self.owner, run_dir=str(run_dir))
        try:
            run_dir.mkdir(mode=0o755, parents=True)
            shutil.copyfile(_FORWARDER, run_dir / "forwarder.py")
            container = await _call(f"docker create {name}", self._create_sync, spec, name, run_dir, labels)
            sandbox = DockerSandbox(self, container.id, name, spec, run_dir)
            for path, text in spec.files.items():
                await sandbox.write_file(path, text)
            # A cancellation that arrived while a worker thread ran is delivered at the
            # next checkpoint: take it here, where the cleanup below still applies.
            await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException as e:
            # Runs also on cancellation: the worker thread has finished by now, so
            # whatever it made is visible to the removal.
            with anyio.CancelScope(shield=True):
                try:
                    await anyio.to_thread.run_sync(self._remove_sync, name)
                except Exception:  # noqa: BLE001 - the reaper removes it later by its labels
                    pass
                shutil.rmtree(run_dir, ignore_errors=True)
            if isinstance(e, OSError):
                raise SandboxError(f"docker create: host run dir {run_dir}: {e}") from e
            raise
        return sandbox

    async def reap(self, ttl_s: float | None = None) -> list[str]:
        """Remove containers and volumes of ours whose owner died or whose TTL passed."""
        from .ownership import is_stale

        def sweep() -> list[str]:
            removed: list[str] = []
            flt = {"label": "miles-env.managed=1"}
            for c in self.client.api.containers(all=True, filters=flt):
                name = c["Names"][0].lstrip("/")
                if is_stale(c.get("Labels") or {}, ttl_s):
                    self._remove_sync(name)
                    shutil.rmtree(
                        (c.get("Labels") or {}).get("miles-env.run-dir", "/nonexistent"), ignore_errors=True
                    )
                    removed.append(name)
            live = {c["Names"][0].lstrip("/") for c in self.client.api.containers(all=True, filters=flt)}
            for v in self.client.api.volumes(filters=flt).get("Volumes") or []:
                if v["Name"] not in live and is_stale(v.get("Labels") or {}, ttl_s):
                    self._remove_sync(v["Name"])
                    removed.append(v["Name"])
            return sorted(set(removed))

        return await _call("docker reap", sweep)


class DockerSandbox:
    """A Sandbox backed by one container; built by DockerSandboxProvider."""

    def __init__(
        self, provider: DockerSandboxProvider, cid: str, name: str, spec: SandboxSpec, run_dir: Path
    ) -> None:
        self.id = name
        self.container_id = cid
        self.workdir = spec.workdir
        self.spec = spec
        # The build context this container's image was built from (SandboxSpec.build), if any.
        self.built_from = spec.build if spec.image is None and spec.rootfs is None else None
        self.run_dir = run_dir
        self._provider = provider
        self._api = provider.client.api
        self._closed = False
        self._listeners: list[_HostListener] = []
        self._forwarders: list[socket.socket] = []
        self._expose_lock = anyio.Lock()
        self._files = ContainerFiles(
            self._api, cid, name, spec.workdir, provider.config.max_read_bytes, self._run, self._explain
        )

    # -- exec ---------------------------------------------------------------------------
    def _wrap(self, cmd: Command) -> list[str]:
        if isinstance(cmd, str):
            argv = ["/bin/sh", "-c", cmd]
        else:
            argv = [str(a) for a in cmd]
            if not argv:
                raise SandboxError("exec: cmd is an empty argv list")
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
    ) -> ExecOutcome:
        self._check_open()
        token = secrets.token_hex(8)
        full_env = {**env, "MILES_EXEC": token}
        stop = threading.Event()
        outcome: ExecOutcome | None = None

        def work() -> ExecOutcome:
            return run_exec(
                self._api, self.container_id, argv, full_env, cwd, stdin, timeout, cap, token, stop
            )

        try:
            outcome = await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as e:
            raise await self._explain(e, "exec") from e
        finally:
            if outcome is None:  # cancelled or failed: make sure nothing of it keeps running
                stop.set()
                with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                    await self._kill_token(token)
        return outcome

    async def _kill_token(self, token: str) -> None:
        def kill() -> None:
            eid = self._api.exec_create(self.container_id, kill_token_argv(token))["Id"]
            self._api.exec_start(eid)

        try:
            await anyio.to_thread.run_sync(kill)
        except Exception:  # noqa: BLE001 - container gone: nothing left to kill
            pass

    async def _explain(self, e: BaseException, what: str) -> SandboxError:
        """Map an engine error, naming the container's state when it stopped or vanished."""
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
        return _map(e, f"sandbox {self.id}: {what}")

    async def exec(
        self,
        cmd: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
    ) -> ExecResult:
        res = self.spec.resources
        args = exec_args(self.spec, self.workdir, timeout=timeout, cwd=cwd, env=env, stdin=stdin)
        out = await self._run(
            self._wrap(cmd),
            env=args.env,
            cwd=args.cwd,
            stdin=args.stdin,
            timeout=args.timeout,
            cap=res.output_bytes,
        )
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

    # -- files (_docker_files.py) ----------------------------------------------------------
    async def write_file(self, path: str, data: bytes | str) -> None:
        self._check_open()
        await self._files.write(path, data)

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        return await self._files.read(path)

    # -- network ------------------------------------------------------------------------
    async def expose(self, url: str) -> str:
        self._check_open()
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SandboxError(f"expose({url!r}): expected an http(s) URL with a host")
        tail = parts.path + (f"?{parts.query}" if parts.query else "")
        if self._provider.config.expose_url:
            return self._provider.config.expose_url.rstrip("/") + tail
        port = parts.port or (443 if parts.scheme == "https" else 80)
        async with self._expose_lock:
            n = len(self._listeners)
            self._listeners.append(
                _HostListener(str(self.run_dir / f"expose-{n}.sock"), (parts.hostname, port))
            )
            inner_port = 20000 + n
            argv = [
                "python3",
                "-u",
                f"{_INNER_RUN}/forwarder.py",
                str(inner_port),
                f"{_INNER_RUN}/expose-{n}.sock",
            ]
            from ._docker_exec import start_detached

            try:
                sock = await anyio.to_thread.run_sync(
                    start_detached, self._api, self.container_id, argv, b"READY", 20.0
                )
            except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as e:
                raise await self._explain(e, "expose") from e
            self._forwarders.append(sock)
        return f"{parts.scheme}://127.0.0.1:{inner_port}{tail}"

    # -- lifecycle ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for s in self._forwarders:
                s.close()
            for listener in self._listeners:
                listener.close()
            try:
                await anyio.to_thread.run_sync(self._provider._remove_sync, self.id)
            except Exception as e:  # noqa: BLE001
                raise _map(e, f"sandbox {self.id}: close (the reaper will retry)") from e
            finally:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    async def __aenter__(self) -> DockerSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"DockerSandbox(id={self.id!r}, closed={self._closed})"
