"""DockerSandboxProvider: one container per sandbox on any Docker-API engine.

Concept: a sandbox is a container made from `spec.image` (or a local rootfs
imported once as an image, or `spec.build` built once per content hash by build.py: bases
resolved through sandboxes/images, RUN steps with a build network),
kept alive by `sh -c "sleep infinity"` under docker-init (the image's ENTRYPOINT, if any, is started
by entrypoint.py once the workspace volume is seeded, with that as its command, as Harbor's compose
starts a task), with a named volume at spec.workdir,
a tmpfs /tmp, no network (`network_mode=none`; network `public`: the engine's bridge, outbound
through its NAT and never the host's loopback, refused on an engine without one; `host`: the
host's own network, loopback included), and memory, CPU and pids limits. Its
root is always writable (the container's own layer, as `docker run` gives, so apt-get,
pip and writes under /opt work as for every Harbor user). Where the engine can cap that
layer at disk_mb (`storage_opt size`: overlay2 on xfs with pquota) the cap is hard;
elsewhere (overlay2 on ext4, most engines) watchdog.py's DiskWatchdog polls the layer's
size and kills a sandbox that grows it past disk_mb: a soft bound, whose slack is one poll
interval (`disk_poll_s`) at the host disk's write speed (see watchdog.py). Every
exec gets the image's ENV, USER, its user's HOME and WORKDIR (sandbox.py, execargs.py).

Privilege: never privileged; every capability dropped but ROOT_CAPABILITIES, the part of
Docker's default set that tasks rely on (apt-get's drop to `_apt`, root writing over other
users' files in its container, a service on port 80), which only the container's root holds;
never MKNOD (device nodes), NET_RAW or anything beyond Docker's set, at exec either: an image's
setuid-root helper (a task's way to give its non-root user a root-only file) runs as the
container's root, as Docker's default runs it, with those capabilities and no more. The
workspace volume is a tmpfs of the local driver (`size` = disk_mb, capped inodes, nosuid,nodev:
a setuid-root file made there never acts as one on the host; owner and mode those of the image's
own directory, files.py), /tmp and /dev/shm are tmpfs of at most disk_mb and 64 MB each.
The container's root is still host uid 0 unless the engine remaps users
(dockerd --userns-remap); that is the engine's configuration, not ours.

Ownership: every container and volume carries labels (managed, run id, owner
host, pid and pid start time, created-at, TTL, host run dir), so `reap()` can
remove what a crashed run left behind.

Lifecycle: create -> (sandbox.py) exec/files/expose -> close (container and volume
removed, run dir deleted, the watchdog told); create cleans up after itself when it fails or is
cancelled; the provider's aclose() stops the watchdog's thread (which also ends by itself
once no sandbox is left). The SDK is synchronous: every call runs in a worker thread (engine.py).
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import docker
import docker.errors

from miles_env.errors import ConfigError, SandboxError, SandboxUnavailable
from miles_env.limits import sandbox_lifetime_s
from miles_env.types import NetworkPolicy, SandboxSpec

from ..entrypoint import HARBOR_COMMAND, start_entrypoint
from ..expose import FORWARDER, INNER_RUN
from ..images.oci import ImageConfig
from ..images.resolve import ResolvedImage
from ..ownership import Ownership, is_stale, owner_labels
from .build import DockerBuilder
from .config import DockerSandboxConfig
from .engine import call
from .files import WorkdirSeed, workdir_seed
from .sandbox import DockerSandbox
from .watchdog import DiskWatchdog

__all__ = ["DockerSandboxProvider", "ROOT_CAPABILITIES"]

# Docker's default set less what tasks do not use (MKNOD, NET_RAW, SETFCAP, SETPCAP, SYS_CHROOT,
# AUDIT_WRITE): apt-get's drop to `_apt`, root writing over other users' files, port 80. The local
# provider gives its root the same (sandboxes/local/namespaces.py ROOT_CAPS; a test keeps them one).
ROOT_CAPABILITIES = (
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "NET_BIND_SERVICE",
)


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
        self._seeds: dict[tuple[str, str], WorkdirSeed] = {}  # (image id, workdir) -> workdir_seed()
        self._configs: dict[str, ImageConfig] = {}  # image id -> its ENV, USER, WORKDIR
        self.layer_quota: bool | None = None  # can the engine cap a container's writable layer?
        self.has_bridge: bool | None = None  # has the engine a `bridge` network (network 'public')?
        self.run_root = Path(self.config.run_root or Path(tempfile.gettempdir()) / "miles-env-docker")
        self.builder = DockerBuilder(self.client, self.config.images, self.config.build_network)
        self.built_bases: dict[str, tuple[ResolvedImage, ...]] = {}  # build tag -> its resolved bases
        # Bounds the writable layer where the engine cannot (layer_quota False): watchdog.py.
        self.watchdog = DiskWatchdog(self.client.api, self.config.disk_poll_s)

    async def ping(self) -> None:
        try:
            await call("docker ping", self.client.ping)
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
            image = spec.image or self.config.image
            if spec.image is not None and not self.builder.has(image):
                # Not in the engine: resolved as a build's base is (mirror, registry, bootstrap, alias).
                with tempfile.TemporaryDirectory(prefix="miles-env-image-") as ctx:
                    (Path(ctx) / "Dockerfile").write_text(f"FROM {image}\n")
                    return self._build_sync(Path(ctx))
            return image
        # A local rootfs becomes an image once (tag = hash of its real path).
        real = os.path.realpath(spec.rootfs)
        tag = f"{self.config.images.repo('rootfs')}:" + hashlib.sha1(real.encode()).hexdigest()[:12]
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
        """dockerd's build of `context` (bases resolved, build network), once per content hash."""
        tag, bases = self.builder.build(context)
        self.built_bases[tag] = bases
        return tag

    def _seed_sync(self, image: str, workdir: str, disk_mb: int, labels: dict[str, str]) -> WorkdirSeed:
        """The image's workdir files, owner and mode: read once per image (files.py)."""
        key = (self.client.api.inspect_image(image)["Id"], workdir)
        if key not in self._seeds:
            self._seeds[key] = workdir_seed(self.client.api, key[0], workdir, disk_mb, labels)
        return self._seeds[key]

    def _create_sync(self, spec: SandboxSpec, name: str, run_dir: Path, labels: dict[str, str]) -> Any:
        res = spec.resources
        network_mode = self._network_mode(spec.network)  # before anything is made: it may refuse
        image = self._image_sync(spec)
        seed = self._seed_sync(image, spec.workdir, res.disk_mb, labels)
        # A tmpfs of the local driver: the quota and nosuid,nodev hold on the host side too.
        inodes = max(1024, res.disk_mb * 128)
        opts = f"size={res.disk_mb}m,nr_inodes={inodes},nosuid,nodev,{seed.mount_opts()}"
        self.client.volumes.create(
            name=name,
            labels=labels,
            driver="local",
            driver_opts={"type": "tmpfs", "device": "tmpfs", "o": opts},
        )
        tmp_mb = min(self.config.tmp_mb, res.disk_mb)
        kwargs = dict(
            image=image,
            entrypoint=[""],  # the image's ENTRYPOINT starts once the workspace is seeded (create)
            command=list(HARBOR_COMMAND),
            name=name,
            labels=labels,
            hostname="sandbox",
            init=True,
            network_mode=network_mode,
            mem_limit=f"{res.memory_mb}m",
            memswap_limit=f"{res.memory_mb}m",
            nano_cpus=int((res.cpus or self.config.cpus) * 1e9),  # the task's, else the provider's
            pids_limit=res.max_procs,
            # exec: a container's /tmp is its root's, where a build and its binary may live (docker's
            # tmpfs default is noexec: go test/build binaries in /tmp were refused)
            tmpfs={"/tmp": f"rw,exec,nosuid,nodev,size={tmp_mb}m,nr_inodes={inodes},mode=1777"},
            shm_size=f"{min(64, res.disk_mb)}m",
            volumes={
                name: {"bind": spec.workdir, "mode": "rw"},
                str(run_dir): {"bind": INNER_RUN, "mode": "ro"},
            },
            working_dir=spec.workdir,
            privileged=False,
            cap_drop=["ALL"],
            cap_add=list(ROOT_CAPABILITIES),
            # no no-new-privileges: an image's setuid helper acts as Docker runs it (its bounding
            # set above caps what it gets: ROOT_CAPABILITIES, never more)
        )
        container = self._create_container(kwargs, res.disk_mb)
        if not self.layer_quota:  # watched from before it starts: no write goes unmeasured
            self.watchdog.watch(container.id, res.disk_mb)
        container.start()
        if seed.tar:
            self.client.api.put_archive(container.id, spec.workdir, seed.tar)
        return container

    def _network_mode(self, network: NetworkPolicy) -> str:
        """The container's network: none; public, the engine's bridge (blocking: asks the engine once)."""
        if network is not NetworkPolicy.PUBLIC:
            return "none" if network is NetworkPolicy.NONE else "host"
        if self.has_bridge is None:
            self.has_bridge = bool(self.client.networks.list(names=["bridge"]))
        if not self.has_bridge:
            raise ConfigError(
                "SandboxSpec.network='public': this Docker engine has no `bridge` network (dockerd "
                "--bridge=none), and the host's network would share its loopback; give the engine a "
                "bridge, or forbid the network with rollout.limits.network: none"
            )
        return "bridge"

    def _create_container(self, kwargs: dict[str, Any], disk_mb: int) -> Any:
        """The container, its writable root capped at disk_mb where the engine can (else watched)."""
        if self.layer_quota is not False:
            try:
                container = self.client.containers.create(**kwargs, storage_opt={"size": f"{disk_mb}m"})
                self.layer_quota = True
                return container
            except docker.errors.APIError as e:
                if "storage-opt" not in str(e) and "storage opt" not in str(e).lower():
                    raise
                self.layer_quota = False  # e.g. overlay2 on extfs: the watchdog bounds the layer
        return self.client.containers.create(**kwargs)

    def image_config_sync(self, image_id: str) -> ImageConfig:
        """The image's ENV, USER, WORKDIR and ENTRYPOINT (`docker image inspect`), once per image."""
        if image_id not in self._configs:
            self._configs[image_id] = ImageConfig.from_oci(
                self.client.api.inspect_image(image_id).get("Config")
            )
        return self._configs[image_id]

    def remove_sync(self, name: str) -> None:
        """Remove container and volume `name`; absent ones are fine (blocking: a worker thread's)."""
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
        lifetime = sandbox_lifetime_s(spec.resources, self.owner.ttl_s)
        labels = owner_labels(self.owner, lifetime, run_dir=str(run_dir))
        try:
            run_dir.mkdir(mode=0o755, parents=True)
            shutil.copyfile(FORWARDER, run_dir / "forwarder.py")
            container = await call(f"docker create {name}", self._create_sync, spec, name, run_dir, labels)
            image = await call("docker image inspect", self.image_config_sync, container.attrs["Image"])
            sandbox = DockerSandbox(self, container.id, name, spec, run_dir, image)
            sandbox.image_bases = self.built_bases.get(container.attrs["Config"]["Image"], ())
            for path, text in spec.files.items():
                await sandbox.write_file(path, text)
            if image.entrypoint:  # after the seed: it sees the image's WORKDIR files, as under compose
                await start_entrypoint(sandbox, image.entrypoint)
            # A cancellation that arrived while a worker thread ran is delivered at the
            # next checkpoint: take it here, where the cleanup below still applies.
            await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException as e:
            # Runs also on cancellation: the worker thread has finished by now, so
            # whatever it made is visible to the removal.
            with anyio.CancelScope(shield=True):
                try:
                    await anyio.to_thread.run_sync(self.remove_sync, name)
                except Exception:  # noqa: BLE001 - the reaper removes it later by its labels
                    pass
                shutil.rmtree(run_dir, ignore_errors=True)
            if isinstance(e, OSError):
                raise SandboxError(f"docker create: host run dir {run_dir}: {e}") from e
            raise
        return sandbox

    async def aclose(self) -> None:
        """Stop the disk watchdog's thread (AsyncClosable); sandboxes still open stay as they are."""
        await anyio.to_thread.run_sync(self.watchdog.close)

    async def reap(self, ttl_s: float | None = None) -> list[str]:
        """Remove containers and volumes of ours whose owner died or whose TTL passed."""

        def sweep() -> list[str]:
            removed: list[str] = []
            flt = {"label": "miles-env.managed=1"}
            for c in self.client.api.containers(all=True, filters=flt):
                name = c["Names"][0].lstrip("/")
                if is_stale(c.get("Labels") or {}, ttl_s):
                    self.remove_sync(name)
                    shutil.rmtree(
                        (c.get("Labels") or {}).get("miles-env.run-dir", "/nonexistent"), ignore_errors=True
                    )
                    removed.append(name)
            live = {c["Names"][0].lstrip("/") for c in self.client.api.containers(all=True, filters=flt)}
            for v in self.client.api.volumes(filters=flt).get("Volumes") or []:
                if v["Name"] not in live and is_stale(v.get("Labels") or {}, ttl_s):
                    self.remove_sync(v["Name"])
                    removed.append(v["Name"])
            return sorted(set(removed))

        return await call("docker reap", sweep)
