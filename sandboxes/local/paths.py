"""Map paths seen inside a sandbox to host paths, and do file I/O without following symlinks.

Invariant: every host file touched by write_file/read_file lies under one of the
sandbox's writable mounts (workspace or /tmp). Paths are normalised lexically,
then opened component by component relative to the mount's directory fd with
O_NOFOLLOW, so a symlink planted by the sandbox (`ln -s /etc/shadow x`) can never
redirect host I/O outside its mounts.
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


def _open_parent(host_dir: str, parts: list[str], create: bool, path: str) -> int:
    fd = os.open(host_dir, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
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
    return SandboxError(f"path {path!r}: {e.strerror}")


def safe_write(host_dir: str, parts: list[str], data: bytes, path: str) -> None:
    parent = _open_parent(host_dir, parts, create=True, path=path)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(parts[-1], flags, 0o644, dir_fd=parent)
    except OSError as e:
        raise _translate(e, path) from e
    finally:
        os.close(parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def safe_read(host_dir: str, parts: list[str], path: str) -> bytes:
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
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise SandboxError(f"path {path!r}: not a regular file")
        return f.read()
