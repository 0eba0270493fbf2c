"""Map paths seen inside a sandbox to host paths, and do file I/O without following symlinks.

Invariant: every host file touched by write_file/read_file lies under one of the
sandbox's writable mounts (workspace or /tmp). Paths are normalised lexically,
then opened component by component relative to the mount's directory fd with
O_NOFOLLOW, so a symlink planted by the sandbox (`ln -s /etc/shadow x`) can never
redirect host I/O outside its mounts. Files and directories the host makes are
given to the sandbox's uid (`owner`), so the sandbox can change them. A read
checks the size first and never takes more than `max_bytes + 1` bytes, so a huge
(or sparse, or growing) file costs the host no memory.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Mapping

from miles_env.errors import SandboxError

__all__ = ["split_inner_path", "safe_write", "safe_read"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def split_inner_path(path: str, workdir: str, mounts: Mapping[str, str]) -> tuple[str, list[str]]:
    """Return (host mount dir, components below it) for an inside path; relative = under workdir."""
    if not path or "\x00" in path:
        raise SandboxError(f"path {path!r}: must be a non-empty path without NUL bytes")
    joined = path if path.startswith("/") else posixpath.join(workdir, path)
    norm = posixpath.normpath(joined)
    for inner, host in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if norm == inner or norm.startswith(inner.rstrip("/") + "/"):
            rest = norm[len(inner) :].strip("/")
            parts = [p for p in rest.split("/") if p]
            if not parts:
                raise SandboxError(f"path {path!r}: names the directory {inner}, not a file")
            return host, parts
    raise SandboxError(
        f"path {path!r} resolves to {norm}, outside the sandbox's writable mounts {sorted(mounts)}"
    )


def _open_parent(
    host_dir: str, parts: list[str], create: bool, path: str, owner: tuple[int, int] | None = None
) -> int:
    fd = os.open(host_dir, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            made = False
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    made = True
                except FileExistsError:
                    pass
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            if made and owner is not None:
                os.fchown(nxt, *owner)
            os.close(fd)
            fd = nxt
        return fd
    except OSError as e:
        os.close(fd)
        raise _translate(e, path) from e


def _translate(e: OSError, path: str) -> SandboxError:
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return SandboxError(f"path {path!r}: a component is a symlink or not a directory (refused)")
    if e.errno == errno.ENOENT:
        return SandboxError(f"path {path!r}: no such file in the sandbox")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return SandboxError(f"path {path!r}: the sandbox's disk quota (Resources.disk_mb) is full")
    return SandboxError(f"path {path!r}: {e.strerror}")


def safe_write(
    host_dir: str, parts: list[str], data: bytes, path: str, owner: tuple[int, int] | None = None
) -> None:
    parent = _open_parent(host_dir, parts, create=True, path=path, owner=owner)
    try:
        # O_NONBLOCK: a FIFO planted by the sandbox must not hang the host (then: not a regular file).
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(parts[-1], flags, 0o644, dir_fd=parent)
    except OSError as e:
        raise _translate(e, path) from e
    finally:
        os.close(parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SandboxError(f"path {path!r}: not a regular file")
            os.set_blocking(fd, True)
            if owner is not None:
                os.fchown(fd, *owner)
            os.ftruncate(fd, 0)
            f.write(data)
    except OSError as e:
        raise _translate(e, path) from e


def safe_read(host_dir: str, parts: list[str], path: str, max_bytes: int) -> bytes:
    parent = _open_parent(host_dir, parts, create=False, path=path)
    try:
        # O_NONBLOCK: a FIFO planted by the sandbox must not hang the host.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(parts[-1], flags, dir_fd=parent)
    except OSError as e:
        raise _translate(e, path) from e
    finally:
        os.close(parent)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SandboxError(f"path {path!r}: not a regular file")
        size = st.st_size
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
        if size > max_bytes or len(data) > max_bytes:  # the second: it grew while we read
            raise SandboxError(
                f"path {path!r}: {max(size, len(data))} bytes, over read_file's cap of {max_bytes} bytes "
                "(max_read_bytes in the provider's config)"
            )
        return data
