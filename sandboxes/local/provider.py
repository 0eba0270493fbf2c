"""LocalSandboxProvider: builds LocalSandbox instances over bubblewrap.

Lifecycle of create(spec): validate the spec, take an idle zygote with its pids cgroup and host
ids (or start one: the only cgroup join, zygote.py says why that matters), make `<root>/<id>`
(mode 0700) and the sandbox's writable tree (storage.py: as root a tmpfs of `disk_mb` owned by
the zygote's unprivileged host uid, else plain directories; layout.py: the writable root, the
workspace seeded with the image's files there), look up the image's user (users.py), have the
zygote start the sandbox (one bwrap, kept running; with network 'public' the zygote then attaches
slirp4netns to its network namespace, network.py), then place spec.files and start the image's
ENTRYPOINT as Harbor's `docker compose up` would (entrypoint.py). If any step fails, whatever was
made is removed before the error propagates.

Sidecars (a task's compose services, sidecars.py): `LocalSandbox.start_sidecar` has the provider
make another sandbox the same way, of the service's image, whose zygote joins the task sandbox's
network namespace instead of making one (root only); it starts no ENTRYPOINT of its own.

Network: `none` (the default) is a network namespace with only `lo`; `public` adds slirp4netns's
`eth0`: outbound TCP/UDP/DNS, never the host's loopback; `host` (the host's own network namespace,
its 127.0.0.1 services included) is refused: no sandbox of ours shares it.

Privilege: nothing in a sandbox holds a capability, makes a further user namespace, or sees
/proc/sys (and /proc/sysrq-trigger, /proc/kcore) writable; /dev is read-only but for /dev/shm
(on the quota). As root each zygote has a range of 65536 host ids of its own (uid_base + a
random slot; two live zygotes share one only by a 1-in-~34,000 chance, and even then their
sandboxes see nothing of each other: every namespace is their own): id 0 inside is the range's
first, so tools see root and the kernel an unprivileged user; host files stay owned by ids the
sandbox does not have, so /etc/shadow and other root-only files stay out of reach.

Reuse: a closed sandbox hands back its zygote and cgroup once nothing else is left in the
cgroup; up to `config.warm` of them stay idle for the next create. They are removed by
`aclose()`, or at garbage collection / interpreter exit. `reap()` removes what crashed runs left
under the same root (reaper.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import sys
import weakref
from pathlib import Path

import anyio

from miles_env.errors import ConfigError, SandboxError
from miles_env.types import NetworkPolicy, Resources, SandboxSpec

from ..entrypoint import start_entrypoint
from ..images.local import LocalImage, LocalImages
from ..images.oci import ImageConfig
from . import layout
from .cgroup import PidsCgroup, remove_orphan_zygote_cgroups
from .config import LocalSandboxConfig, find_bwrap, find_slirp4netns
from .forkserver import Zygote, start_zygote
from .reaper import reap_local
from .sandbox import LocalSandbox
from .storage import Storage, bwrap_for_others, prepare_mount_dir, remove_orphan_mounts
from .users import resolve_user

__all__ = ["LocalSandboxProvider"]

_log = logging.getLogger(__name__)
_SPAN = 1 << 16  # host ids per zygote, as root: an image's uids and gids 0..65535 (nobody included)
_PROCS_OVERHEAD = 2  # the zygote and the sandbox's init: not the sandbox's to count
_NETWORK_OVERHEAD = 1  # slirp4netns, for a sandbox with network


def _dispose(idle: list[tuple[Zygote, PidsCgroup | None]]) -> None:
    """Synchronous clean-up of idle zygotes and their cgroups (aclose, finalizer, exit)."""
    while idle:
        zygote, cgroup = idle.pop()
        zygote.close()
        if cgroup is not None:
            cgroup.remove()


class LocalSandboxProvider:
    """SandboxProvider "local": bubblewrap sandboxes on this host."""

    name = "local"

    def __init__(self, config: LocalSandboxConfig | None = None) -> None:
        self.config = config or LocalSandboxConfig()
        self.bwrap = find_bwrap(self.config.bwrap)
        self.root = self.config.resolved_root().absolute()
        self.mount_dir: Path | None = None  # as root: where each sandbox's tmpfs is mounted
        if os.geteuid() == 0:
            self.mount_dir = prepare_mount_dir(self.config.resolved_mount_dir())
            self.bwrap = bwrap_for_others(self.bwrap, self.mount_dir)
            remove_orphan_mounts(self.mount_dir)  # what a crashed run left, once the reaper removed its dir
        self._idle: list[tuple[Zygote, PidsCgroup | None]] = []
        self._images: LocalImages | None = None  # made on the first spec with a build or an image
        self._warned_no_mount = False
        self._warned_no_cpu = False
        if self.config.use_cgroup:
            remove_orphan_zygote_cgroups()  # what killed runs left: empty cgroups, a few ms at most
        weakref.finalize(self, _dispose, self._idle)

    def _validate(self, spec: SandboxSpec) -> None:
        if not spec.workdir.startswith("/") or spec.workdir.rstrip("/") in ("", "/tmp", "/proc", "/dev"):
            raise ConfigError(
                f"SandboxSpec.workdir={spec.workdir!r}: must be an absolute, dedicated directory"
            )
        if spec.rootfs is not None and not os.path.isdir(spec.rootfs):
            raise ConfigError(f"SandboxSpec.rootfs={spec.rootfs!r}: not a directory on the host")
        if spec.network is NetworkPolicy.HOST:
            raise ConfigError(
                "SandboxSpec.network='host' is not supported by the local provider (it would share "
                "the host's loopback); 'public' gives a sandbox outbound network"
            )

    def _host_ids(self) -> tuple[int, int]:
        """(first host uid, span) for a new zygote's sandboxes: a random slot as root, else our uid."""
        if self.mount_dir is None:
            return os.getuid(), 1
        slots = ((1 << 32) - 2 - self.config.uid_base) // _SPAN
        return self.config.uid_base + secrets.randbelow(slots) * _SPAN, _SPAN

    def _zygote(self, sandbox_id: str, res: Resources, overhead: int) -> tuple[Zygote, PidsCgroup | None]:
        """An idle zygote and its cgroup, or new ones (no cgroup where none can be made); the cgroup
        holds `overhead` processes that are not the sandbox's beside its own max_procs."""
        while self._idle:
            zygote, cgroup = self._idle.pop()
            if zygote.process.poll() is None:
                break
            if cgroup is not None:
                cgroup.remove()  # the zygote died while idle
        else:
            cgroup = None
            if self.config.use_cgroup:
                cgroup = PidsCgroup.create(f"miles-env-z{sandbox_id}", res.max_procs + overhead)
            zygote = start_zygote(sys.executable, cgroup, self._host_ids())
        if cgroup is not None:
            cgroup.set_max(res.max_procs + overhead)
            if not cgroup.set_cpus(res.cpus) and not self._warned_no_cpu:
                self._warned_no_cpu = True
                _log.warning("local sandbox: no writable cpu cgroup here; Resources.cpus is not enforced")
        return zygote, cgroup

    def _give_back(self, zygote: Zygote, cgroup: PidsCgroup | None, stopped: bool) -> None:
        if stopped and len(self._idle) < self.config.warm:
            self._idle.append((zygote, cgroup))
        else:
            _dispose([(zygote, cgroup)])

    def _storage(self, host_dir: Path, zygote: Zygote, spec: SandboxSpec) -> Storage:
        ids = (zygote.ids[0], zygote.ids[0]) if self.mount_dir is not None else None
        storage = Storage.make(host_dir, self.mount_dir, ids, spec.resources.disk_mb)
        if ids is not None and not storage.mounted and not self._warned_no_mount:
            self._warned_no_mount = True
            _log.warning(
                "local sandbox: root here may not mount a tmpfs under %s; sandboxes get plain "
                "directories, so Resources.disk_mb caps single files only, not a sandbox's total",
                self.mount_dir,
            )
        layout.prepare(storage, spec, self.config.hostname)
        if spec.rootfs is not None:
            layout.seed_workdir(spec.rootfs, spec.workdir, storage.path("work"), storage.ids)
        return storage

    def image_config(self, spec: SandboxSpec) -> ImageConfig | None:
        """The ENV, USER and WORKDIR every exec of `spec`'s sandbox gets: its image's; None for the
        host's view (no image). A rootfs that comes with no config gets the empty one."""
        return None if spec.rootfs is None else ImageConfig()

    async def create(self, spec: SandboxSpec) -> LocalSandbox:
        if not isinstance(spec, SandboxSpec):
            raise ConfigError(f"create(spec): expected a SandboxSpec, got {type(spec).__name__}")
        return await self._create(spec)

    async def _sidecar(self, spec: SandboxSpec, beside: Zygote) -> LocalSandbox:
        """A sandbox in the network namespace of `beside`'s running sandbox, its image's ENTRYPOINT
        not started: a compose sidecar's (sidecars.py starts its command)."""
        if self.mount_dir is None:
            raise SandboxError(
                "compose sidecars on the local provider need root (joining another sandbox's network "
                "namespace does); run as root or use the docker provider"
            )
        return await self._create(spec, beside=beside)

    async def _create(self, spec: SandboxSpec, beside: Zygote | None = None) -> LocalSandbox:
        built: LocalImage | None = None
        if spec.rootfs is None and (spec.build is not None or spec.image is not None):
            # The task's image, built and unpacked once per content hash (sandboxes/images/local.py):
            # the lower layer of the sandbox's root, with its config for every exec.
            self._images = self._images or LocalImages(self.config.images)
            built = await anyio.to_thread.run_sync(self._images.get, spec)
            spec = spec.model_copy(update={"rootfs": str(built.rootfs)})
        self._validate(spec)
        public = spec.network is NetworkPolicy.PUBLIC and beside is None  # a sidecar has its sandbox's
        slirp = find_slirp4netns(self.config.slirp4netns) if public else None
        image = built.config if built is not None else self.image_config(spec)
        sandbox_id = secrets.token_hex(6)
        host_dir = self.root / sandbox_id
        overhead = _PROCS_OVERHEAD + (_NETWORK_OVERHEAD if slirp else 0)
        zygote, cgroup = self._zygote(sandbox_id, spec.resources, overhead)
        storage: Storage | None = None
        try:
            user = resolve_user(spec.rootfs, image.user if image else None, zygote.ids[1])
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            host_dir.mkdir(mode=0o700)
            storage = self._storage(host_dir, zygote, spec)
            idmap = (spec.rootfs, str(storage.path("lower"))) if spec.rootfs and storage.ids else None
            options = layout.options(spec, storage, self.config, own_net=beside is None)
            netns = await beside.netns() if beside is not None else None
            init_pid = await zygote.start(self.bwrap, options, idmap, slirp, netns)
        except BaseException as e:
            if storage is not None:
                storage.remove()
            shutil.rmtree(host_dir, ignore_errors=True)
            _dispose([(zygote, cgroup)])  # it may hold half a sandbox: a fresh one is cheaper to trust
            if isinstance(e, OSError):
                raise SandboxError(f"creating sandbox under {self.root}: {e}") from e
            raise
        sandbox = LocalSandbox(
            sandbox_id=sandbox_id,
            spec=spec,
            storage=storage,
            zygote=zygote,
            cgroup=cgroup,
            max_read_bytes=self.config.max_read_bytes,
            image=image,
            user=user,
            on_close=self._give_back,
            init_pid=init_pid,
            make_sidecar=self._sidecar,
        )
        if built is not None:  # the bases it was built on (recorded in the episode's metadata)
            sandbox.image_bases = built.bases
        try:
            for path, text in spec.files.items():
                await sandbox.write_file(path, text)
            # As `docker compose up` starts it (entrypoint.py); a sidecar runs its own command.
            if image is not None and image.entrypoint and beside is None:
                await start_entrypoint(sandbox, image.entrypoint)
        except BaseException as e:
            await sandbox.close()
            if isinstance(e, OSError):
                raise SandboxError(f"creating sandbox under {self.root}: {e}") from e
            raise
        return sandbox

    async def aclose(self) -> None:
        """Stop the idle zygotes and remove their cgroups (open sandboxes are their owners' to close)."""
        _dispose(self._idle)

    async def reap(self, ttl_s: float | None = None) -> list[str]:
        """Remove the stale workspaces under this provider's root, their cgroups and mounts."""
        return await anyio.to_thread.run_sync(reap_local, self.root, ttl_s, self.mount_dir)
