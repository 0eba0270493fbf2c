"""LocalSandboxProvider: builds LocalSandbox instances over bubblewrap.

Lifecycle of create(spec): validate the spec, make `<root>/<id>` (mode 0700) and the
sandbox's writable tree (storage.py: as root a tmpfs of `disk_mb` with its own
unprivileged host uid, else plain directories), take an idle zygote with its pids
cgroup (or start one: the only cgroup join, zygote.py says why that matters), place
spec.files, and precompute the bwrap argv so that each exec is one fork. If any step
fails, whatever was made is removed before the error propagates.

Privilege: every bwrap drops all capabilities, cannot make further user namespaces,
sees /proc/sys (and /proc/sysrq-trigger, /proc/kcore) read-only and a read-only /dev
but for /dev/shm (on the quota). As root, bwrap itself runs as the sandbox's host uid
(the zygote or `setpriv` drops to it) and maps it to uid 0 inside: tools see root, the
kernel sees an unprivileged user, so host sysctls, /etc/shadow and other root-only
files stay out of reach (bwrap run by root would keep uid 0 and its capabilities).

Reuse: a closed sandbox hands back its zygote and cgroup once nothing else is left
in the cgroup; up to `config.warm` of them stay idle for the next create. They are
removed by `aclose()`, or at garbage collection / interpreter exit. `reap()` removes
what crashed runs left under the same root (reaper.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import shutil
import sys
import weakref
from pathlib import Path

import anyio

from miles_env.errors import ConfigError, SandboxError, SandboxUnavailable
from miles_env.types import NetworkPolicy, Resources, SandboxSpec

from ..images.local import LocalImages
from .cgroup import PidsCgroup, remove_orphan_zygote_cgroups
from .config import LocalSandboxConfig, find_bwrap, host_root_binds
from .forkserver import Zygote, start_zygote
from .reaper import reap_local
from .sandbox import LocalSandbox
from .storage import Storage, bwrap_for_others, prepare_mount_dir, remove_orphan_mounts

__all__ = ["LocalSandboxProvider"]

_log = logging.getLogger(__name__)

# Read-only over the sandbox's own /proc: host-global kernel knobs (bwrap skips /proc/sys when
# it looks unwritable to it, which says nothing about who else could write it).
_PROC_RO = ["--ro-bind", "/proc/sys", "/proc/sys"]
for _path in ("/proc/sysrq-trigger", "/proc/kcore"):
    _PROC_RO += ["--ro-bind-try", _path, _path]
_UID_SPAN = 1 << 24


def _limit_prefix(res: Resources, cgroup: PidsCgroup | None, prlimit: str) -> list[str]:
    """argv that joins the cgroup and sets rlimits in one shell, then execs bwrap (no extra fork).

    The shell writes its own pid into cgroup.procs before exec'ing bwrap, so
    every descendant is counted. ulimit units are POSIX (-f in 512-byte blocks)
    or shared by dash and bash (-v in KiB, -t in seconds). CPU soft < hard: the
    kernel sends SIGXCPU first, which tells the cause apart from our SIGKILL.
    """
    steps = [f"echo $$ > {shlex.quote(f)}" for f in (cgroup.procs_files if cgroup is not None else [])]
    steps += [
        f"ulimit -S -t {res.cpu_seconds}",
        f"ulimit -H -t {res.cpu_seconds + 1}",
        f"ulimit -v {res.memory_mb << 10}",
        f"ulimit -f {res.disk_mb << 11}",
        "ulimit -c 0",
    ]
    script = " && ".join(steps) + ' || exit 125; exec "$@"'
    prefix = ["/bin/sh", "-c", script, "sh"]
    if cgroup is None:
        # Without a pids cgroup, RLIMIT_NPROC is the fallback: it counts per uid and does not bind
        # root, but as root each sandbox runs as a uid of its own, so it binds there too.
        prefix += [prlimit, f"--nproc={res.max_procs}:{res.max_procs}", "--"]
    return prefix


def _dispose(idle: list[tuple[Zygote, PidsCgroup]]) -> None:
    """Synchronous clean-up of idle zygotes and their cgroups (aclose, finalizer, exit)."""
    while idle:
        zygote, cgroup = idle.pop()
        zygote.close()
        cgroup.remove()


class LocalSandboxProvider:
    """SandboxProvider "local": bubblewrap sandboxes on this host."""

    name = "local"

    def __init__(self, config: LocalSandboxConfig | None = None) -> None:
        self.config = config or LocalSandboxConfig()
        self.bwrap = find_bwrap(self.config.bwrap)
        prlimit = shutil.which("prlimit")
        if prlimit is None:
            raise SandboxUnavailable("`prlimit` (util-linux) not found on PATH; the local sandbox needs it")
        self._prlimit = prlimit
        self.root = self.config.resolved_root().absolute()
        self.mount_dir: Path | None = None  # as root: where each sandbox's tmpfs is mounted
        self._setpriv = ""
        if os.geteuid() == 0:
            # Also where util-linux lives when PATH is narrowed (a caller's PATH is not ours to need).
            setpriv = shutil.which("setpriv") or shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
            if setpriv is None:
                raise SandboxUnavailable(
                    "`setpriv` (util-linux) not found on PATH; as root the local sandbox needs it"
                )
            self._setpriv = setpriv
            self.mount_dir = prepare_mount_dir(self.config.resolved_mount_dir())
            self.bwrap = bwrap_for_others(self.bwrap, self.mount_dir)
            remove_orphan_mounts(self.mount_dir)  # what a crashed run left, once the reaper removed its dir
        self._idle: list[tuple[Zygote, PidsCgroup]] = []
        self._images: LocalImages | None = None  # made on the first spec with a build or an image
        self._warned_no_mount = False
        self._warned_no_cpu = False
        if self.config.use_cgroup:
            remove_orphan_zygote_cgroups()  # what killed runs left: empty cgroups, a few ms at most
        weakref.finalize(self, _dispose, self._idle)

    def _bwrap_prefix(self, spec: SandboxSpec, storage: Storage) -> list[str]:
        args = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
        args += ["--new-session", "--cap-drop", "ALL", "--hostname", self.config.hostname]
        if storage.ids is not None:
            args += ["--uid", "0", "--gid", "0"]  # root inside, storage.ids on the host
        if spec.rootfs is not None:
            args += ["--bind", storage.reachable(spec.rootfs), "/"]
        else:
            args += host_root_binds()
            for path in self.config.extra_ro_binds:
                args += ["--ro-bind", storage.reachable(path), path]
        work, tmp, shm = (str(storage.path(sub)) for sub in ("work", "tmp", "shm"))
        args += ["--bind", work, spec.workdir, "--bind", tmp, "/tmp"]
        args += ["--proc", "/proc", *_PROC_RO, "--dev", "/dev", "--bind", shm, "/dev/shm"]
        # The root itself (bwrap's tmpfs, or the rootfs) and /dev's tmpfs are read-only: writes
        # go to the binds only, all of them on the sandbox's quota.
        return args + ["--remount-ro", "/dev", "--remount-ro", "/", "--clearenv"]

    def _ids(self, sandbox_id: str) -> tuple[int, int] | None:
        """The host uid/gid of a sandbox, as root; another sandbox shares it only by a 1 in 2**24 chance."""
        if self.mount_dir is None:
            return None
        uid = self.config.uid_base + int(sandbox_id, 16) % _UID_SPAN
        return uid, uid

    def _drop_prefix(self, ids: tuple[int, int] | None) -> list[str]:
        """argv that becomes `ids` before exec'ing bwrap (for the processes we start without the zygote)."""
        if ids is None:
            return []
        return [self._setpriv, f"--reuid={ids[0]}", f"--regid={ids[1]}", "--clear-groups", "--"]

    def _validate(self, spec: SandboxSpec) -> None:
        if not spec.workdir.startswith("/") or spec.workdir.rstrip("/") in ("", "/tmp", "/proc", "/dev"):
            raise ConfigError(
                f"SandboxSpec.workdir={spec.workdir!r}: must be an absolute, dedicated directory"
            )
        if spec.rootfs is not None and not os.path.isdir(spec.rootfs):
            raise ConfigError(f"SandboxSpec.rootfs={spec.rootfs!r}: not a directory on the host")
        if spec.network is NetworkPolicy.HOST:
            raise ConfigError("SandboxSpec.network='host' is not supported by the local provider")

    def _zygote(self, sandbox_id: str, res: Resources) -> tuple[Zygote | None, PidsCgroup | None]:
        """An idle zygote and its cgroup, or new ones; (None, None) where no cgroup can be made."""
        max_procs = res.max_procs
        if not self.config.use_cgroup:
            return None, None
        while self._idle:
            zygote, cgroup = self._idle.pop()
            if zygote.process.poll() is None:
                break
            cgroup.remove()  # the zygote died while idle
        else:
            made = PidsCgroup.create(f"miles-env-z{sandbox_id}", max_procs + 1)
            if made is None:
                return None, None
            zygote, cgroup = start_zygote(sys.executable, made), made
        cgroup.set_max(max_procs + 1)  # + the zygote itself
        if not cgroup.set_cpus(res.cpus) and not self._warned_no_cpu:
            self._warned_no_cpu = True
            _log.warning("local sandbox: no writable cpu cgroup here; Resources.cpus is not enforced")
        return zygote, cgroup

    def _give_back(self, zygote: Zygote, cgroup: PidsCgroup) -> None:
        if len(self._idle) < self.config.warm:
            self._idle.append((zygote, cgroup))
        else:
            _dispose([(zygote, cgroup)])

    async def create(self, spec: SandboxSpec) -> LocalSandbox:
        if not isinstance(spec, SandboxSpec):
            raise ConfigError(f"create(spec): expected a SandboxSpec, got {type(spec).__name__}")
        image = None
        if spec.rootfs is None and (spec.build is not None or spec.image is not None):
            # The task's image, built and unpacked once per content hash (sandboxes/images/local.py).
            self._images = self._images or LocalImages(self.config.images)
            image = await anyio.to_thread.run_sync(self._images.get, spec)
            spec = spec.model_copy(update={"rootfs": str(image.rootfs)})
        self._validate(spec)
        sandbox_id = secrets.token_hex(6)
        host_dir = self.root / sandbox_id
        ids = self._ids(sandbox_id)
        storage = None
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            host_dir.mkdir(mode=0o700)
            storage = Storage.make(host_dir, self.mount_dir, ids, spec.resources.disk_mb)
            if ids is not None and not storage.mounted and not self._warned_no_mount:
                self._warned_no_mount = True
                _log.warning(
                    "local sandbox: root here may not mount a tmpfs under %s; sandboxes get plain "
                    "directories, so Resources.disk_mb caps single files only, not a sandbox's total",
                    self.mount_dir,
                )
            bwrap_prefix = self._bwrap_prefix(spec, storage)
            zygote, cgroup = self._zygote(sandbox_id, spec.resources)
        except BaseException as e:
            if storage is not None:
                storage.remove()
            shutil.rmtree(host_dir, ignore_errors=True)
            if isinstance(e, OSError):
                raise SandboxError(f"creating sandbox under {self.root}: {e}") from e
            raise
        sandbox = LocalSandbox(
            sandbox_id=sandbox_id,
            spec=spec,
            storage=storage,
            bwrap_prefix=bwrap_prefix,
            limit_prefix=_limit_prefix(spec.resources, cgroup, self._prlimit),
            drop_prefix=self._drop_prefix(ids),
            cgroup=cgroup,
            python=self.config.python,
            max_read_bytes=self.config.max_read_bytes,
            zygote=zygote,
            on_close=self._give_back,
        )
        if image is not None:  # what the image says execs get (ENV, USER, WORKDIR), and its bases
            sandbox.image_config, sandbox.image_bases = image.config, image.bases
        try:
            for path, text in spec.files.items():
                await sandbox.write_file(path, text)
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
