"""The mounts of a local sandbox: a writable root of its own, the workspace, /tmp, /proc, /dev.

Concept: every sandbox has a writable root whose writes land on its own storage (storage.py: as
root a tmpfs of `disk_mb`, so they count in the quota) and are gone at close.
  - With `spec.rootfs` (an image's files): an overlay at / whose lower layer is the rootfs, shared
    read-only by every sandbox of that image, and whose upper layer is the sandbox's. As root the
    lower layer is an idmapped copy of the rootfs (the zygote makes it: namespaces.idmapped_tree),
    so a file the image gives uid k is owned by uid k inside the sandbox, whichever host range the
    sandbox has, without touching the files on disk. Without root it is the rootfs itself.
  - Without one (the host's view): / is a directory of the sandbox's storage, with overlays of the
    host's /usr, /etc and /opt (and its /bin, /lib... links). The host's files are NOT mapped: they
    stay owned by ids the sandbox does not have (nobody, inside), so root-only host files such as
    /etc/shadow stay unreadable and host files stay read-only; but each overlay's top directory and
    /usr/local's directories (down to depth 3) are the sandbox's own, so new files go there (and
    anywhere under /, e.g. /var/log), into its upper layer.
Then the workspace (`<storage>/work`, seeded from the image's files at that path) at spec.workdir,
`<storage>/tmp` at /tmp, a private /proc with the host-global knobs read-only, a read-only /dev
with `<storage>/shm` as /dev/shm, and an /etc/hosts naming localhost and the sandbox. A sandbox
with network (NetworkPolicy.PUBLIC, network.py) also gets an /etc/resolv.conf naming
slirp4netns's DNS forwarder, over the image's or the host's, as docker writes its own.

`options()` is the bwrap command line for that; the zygote adds the user and pid namespaces (its
own), the status and block fds and the command.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from miles_env.types import NetworkPolicy, SandboxSpec

from .config import LocalSandboxConfig
from .storage import Storage

__all__ = ["HOSTS", "options", "prepare", "seed_workdir"]

HOST_OVERLAYS = ("usr", "etc", "opt")
_HOST_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_LOCAL_DEPTH = 3
# Read-only over the sandbox's own /proc: host-global kernel knobs (bwrap skips /proc/sys when
# it looks unwritable to it, which says nothing about who else could write it).
_PROC_RO = ["--ro-bind", "/proc/sys", "/proc/sys"]
for _path in ("/proc/sysrq-trigger", "/proc/kcore"):
    _PROC_RO += ["--ro-bind-try", _path, _path]
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{name}\n"
RESOLV_CONF = "nameserver 10.0.2.3\n"  # slirp4netns's DNS forwarder (network.py)


def _local_dirs() -> list[str]:
    """/usr/local's directories down to _LOCAL_DEPTH, relative to /usr (real directories only)."""
    out = []
    for top, dirs, _ in os.walk("/usr/local"):
        depth = top.count("/") - 2
        dirs[:] = (
            [d for d in dirs if not os.path.islink(os.path.join(top, d))] if depth < _LOCAL_DEPTH else []
        )
        out.append(os.path.relpath(top, "/usr"))
    return out


def prepare(storage: Storage, spec: SandboxSpec, hostname: str) -> None:
    """Make the directories the mounts need on the sandbox's storage (owned by the sandbox's root)."""
    storage.mkdir("upper")
    storage.mkdir("ovwork", mode=0o700)
    storage.path("run", "hosts").write_text(HOSTS.format(name=hostname))
    etc = ["hosts"]
    if spec.network is NetworkPolicy.PUBLIC:
        storage.path("run", "resolv.conf").write_text(RESOLV_CONF)
        etc.append("resolv.conf")
    if storage.ids is not None:
        for name in etc:
            os.chown(storage.path("run", name), *storage.ids)
    if spec.rootfs is not None:
        storage.mkdir("lower", owned=False)
        return
    storage.mkdir("root")
    for name in HOST_OVERLAYS:
        if os.path.isdir(f"/{name}") and not os.path.islink(f"/{name}"):
            storage.mkdir(f"upper/{name}")
            storage.mkdir(f"ovwork/{name}", mode=0o700)
    if os.path.isdir("/usr/local"):
        for rel in _local_dirs():
            storage.mkdir(f"upper/usr/{rel}")


def _root(spec: SandboxSpec, storage: Storage, config: LocalSandboxConfig) -> list[str]:
    upper, work = storage.path("upper"), storage.path("ovwork")
    if spec.rootfs is not None:
        lower = str(storage.path("lower")) if storage.ids is not None else storage.reachable(spec.rootfs)
        return ["--overlay-src", lower, "--overlay", str(upper), str(work), "/"]
    args = ["--bind", str(storage.path("root")), "/"]
    for name in HOST_OVERLAYS:
        if (upper / name).is_dir():
            args += [
                "--overlay-src",
                f"/{name}",
                "--overlay",
                str(upper / name),
                str(work / name),
                f"/{name}",
            ]
    for name in _HOST_LINKS:  # links into /usr on a merged-/usr host; else read-only as they are
        if os.path.islink(f"/{name}"):
            args += ["--symlink", os.readlink(f"/{name}"), f"/{name}"]
        elif os.path.isdir(f"/{name}"):
            args += ["--ro-bind", f"/{name}", f"/{name}"]
    for path in config.extra_ro_binds:
        args += ["--ro-bind", storage.reachable(path), path]
    return args


def options(
    spec: SandboxSpec, storage: Storage, config: LocalSandboxConfig, *, own_net: bool = True
) -> list[str]:
    """bwrap's options for the sandbox's namespaces and mounts (no user namespace flags, no command).
    `own_net=False`: a sidecar's, in the network namespace the zygote puts bwrap in (sidecars.py)."""
    args = ["--unshare-net"] if own_net else []
    args += ["--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    args += ["--assert-userns-disabled", "--cap-drop", "ALL", "--uid", "0", "--gid", "0"]
    args += ["--hostname", config.hostname, *_root(spec, storage, config)]
    args += ["--bind", str(storage.path("work")), spec.workdir, "--bind", str(storage.path("tmp")), "/tmp"]
    args += ["--bind", str(storage.path("run", "hosts")), "/etc/hosts"]
    if spec.network is NetworkPolicy.PUBLIC:
        args += ["--bind", str(storage.path("run", "resolv.conf")), "/etc/resolv.conf"]
    args += ["--proc", "/proc", *_PROC_RO, "--dev", "/dev", "--bind", str(storage.path("shm")), "/dev/shm"]
    return [*args, "--remount-ro", "/dev"]


def seed_workdir(rootfs: str, workdir: str, dest: Path, shift: tuple[int, int] | None) -> None:
    """Copy the image's files under `workdir` into the workspace `dest`, as a container's volume
    starts with them; owners move by `shift` (the sandbox's host uid and gid for id 0)."""
    src = os.path.join(rootfs, workdir.lstrip("/"))
    if not os.path.isdir(src) or os.path.islink(src):
        return

    def own(path: str, st: os.stat_result) -> None:
        if shift is not None:
            os.lchown(path, shift[0] + st.st_uid, shift[1] + st.st_gid)

    for top, dirs, files in os.walk(src):
        rel = os.path.relpath(top, src)
        target = dest if rel == "." else dest / rel
        if rel != ".":
            target.mkdir()
        st = os.lstat(top)
        own(str(target), st)
        os.chmod(target, stat.S_IMODE(st.st_mode))
        for name in [*files, *(d for d in dirs if os.path.islink(os.path.join(top, d)))]:
            path = os.path.join(top, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(path), target / name)
            elif stat.S_ISREG(st.st_mode):
                shutil.copy2(path, target / name, follow_symlinks=False)
            else:
                continue  # devices, fifos, sockets: not a workspace's
            own(str(target / name), st)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
