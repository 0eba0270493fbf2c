"""File I/O of a docker sandbox: write_file/read_file through the engine's archive API.

Concept: a path is resolved against the sandbox's workdir and must land in one of its
writable mounts (the workspace volume or /tmp). Workspace files travel as one-file tar
archives (put_archive/get_archive); /tmp is a container tmpfs the archive API cannot
see, so those go through a shell exec of the sandbox (`ExecRunner`), which refuses
symlinks at the last component. Both ways the file is root's, whoever the image's USER is (as
`docker cp` and the local provider's write_file make it): a folder the sandbox's root made for
what it uploads (Harbor's tests, next to an agent running as another user) takes its files.

Invariant: read_file never returns, and never streams into memory, more than
`max_read_bytes` (+ one tar header's slack): the size is checked first (a HEAD of the
archive endpoint, or `stat` in /tmp) and again while reading, since a file may grow.

Seeding: the engine fills an empty named volume from the image (files, and the directory's
owner and mode), but not a tmpfs one; `workdir_seed()` reads the image's own files under the
workdir once (through a container that never starts) as a tar re-rooted at the workdir, for
the provider to copy into each new sandbox's volume (capped at disk_mb), and the directory's
own uid, gid and mode, which become the tmpfs's mount options (so an image whose non-root
USER owns its WORKDIR can write it, as under docker's own volumes).

All calls into the Docker SDK here are synchronous; `ContainerFiles` runs them in a
worker thread, `workdir_seed()` expects to be called from one.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import docker
import docker.errors
import docker.utils
import requests.exceptions

from miles_env.errors import SandboxError

from .exec import ExecOutcome

__all__ = ["ContainerFiles", "ErrorExplainer", "ExecRunner", "WorkdirSeed", "strip_top", "workdir_seed"]

# Writes stdin to $1, making its parents; refuses a symlink at $1.
_WRITE_TMP = 'mkdir -p "$(dirname "$1")" && [ ! -L "$1" ] && cat > "$1"'
# Prints at most $2 + 1 bytes of the regular file $1: exit 2 when it is none, 3 (size on stderr) when too big.
_READ_TMP = (
    '[ -f "$1" ] && [ ! -L "$1" ] || { echo "not a regular file" >&2; exit 2; }; '
    's=$(stat -c %s "$1") && [ "$s" -le "$2" ] || { echo "$s" >&2; exit 3; }; head -c "$(($2 + 1))" "$1"'
)
_TAR_SLACK = 64 << 10  # a one-file tar: the file plus its headers and padding


class ExecRunner(Protocol):
    """Runs an argv in the sandbox's container (no wrapper shell), as DockerSandbox._run does."""

    async def __call__(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        stdin: bytes | None,
        timeout: float,
        cap: int,
        user: str = "",
    ) -> ExecOutcome: ...


class ErrorExplainer(Protocol):
    """Turns an engine error into a SandboxError naming the container's state."""

    async def __call__(self, e: BaseException, what: str) -> SandboxError: ...


@dataclass(frozen=True, slots=True)
class WorkdirSeed:
    """The image's workdir: its files (a tar relative to it, b"" if none) and its own owner and mode."""

    tar: bytes = b""
    uid: int = 0
    gid: int = 0
    mode: int = 0o755  # a workdir the image lacks: made root-owned 0755, as the engine makes it

    def mount_opts(self) -> str:
        """tmpfs mount options that give the mount point the image directory's owner and mode."""
        return f"uid={self.uid},gid={self.gid},mode={self.mode & 0o7777:04o}"


def strip_top(archive: bytes) -> WorkdirSeed:
    """A tar of `dir/...` (as the archive API returns a directory) re-rooted at `dir`, and dir's owner."""
    out = io.BytesIO()
    count = 0
    top: tarfile.TarInfo | None = None
    with tarfile.open(fileobj=io.BytesIO(archive)) as src, tarfile.open(fileobj=out, mode="w") as dst:
        for member in src:
            _, sep, rest = member.name.partition("/")
            if not sep or not rest:
                top = top or member  # the directory itself: its owner and mode go to the mount point
                continue
            data = src.extractfile(member) if member.isfile() else None
            member.name = rest
            if member.islnk():  # a hard link names its target by archive path, re-rooted too
                member.linkname = member.linkname.partition("/")[2]
            dst.addfile(member, data)
            count += 1
    tar = out.getvalue() if count else b""
    if top is None or not top.isdir():
        return WorkdirSeed(tar)
    return WorkdirSeed(tar, top.uid, top.gid, top.mode)


def workdir_seed(api: Any, image_id: str, workdir: str, disk_mb: int, labels: dict[str, str]) -> WorkdirSeed:
    """The image's own files under `workdir` and that directory's owner and mode; blocking."""
    helper = api.create_container(image_id, command=["true"], labels=labels)["Id"]
    try:
        stream, _ = api.get_archive(helper, workdir)
        raw = bytearray()
        for chunk in stream:
            raw += chunk
            if len(raw) > disk_mb << 20:
                raise SandboxError(f"the image's files under {workdir} exceed disk_mb={disk_mb}")
        return strip_top(bytes(raw))
    except docker.errors.NotFound:
        return WorkdirSeed()
    finally:
        api.remove_container(helper, force=True)


def _one_file_tar(rel: str, payload: bytes) -> bytes:
    """A tar holding `rel` (with its parent directories, 0755) of `payload`, mode 0644."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            info = tarfile.TarInfo("/".join(parts[:i]))
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
            tar.addfile(info)
        info = tarfile.TarInfo(rel)
        info.size, info.mode, info.mtime = len(payload), 0o644, int(time.time())
        tar.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


@dataclass(frozen=True, slots=True)
class ContainerFiles:
    """write/read of one sandbox's files; `api` is the engine's docker.APIClient."""

    api: Any
    container_id: str
    sandbox_id: str
    workdir: str
    max_read_bytes: int
    run: ExecRunner
    explain: ErrorExplainer

    def inner(self, path: str) -> str:
        """`path` inside the container, or a SandboxError when it leaves the writable mounts."""
        if not path or "\x00" in path:
            raise SandboxError(f"path {path!r}: must be a non-empty path without NUL bytes")
        norm = posixpath.normpath(posixpath.join(self.workdir, path))
        for mount in (self.workdir, "/tmp"):
            if norm.startswith(mount.rstrip("/") + "/"):
                return norm
        raise SandboxError(f"path {path!r} resolves to {norm}, outside the sandbox's writable mounts")

    def too_big(self, path: str, size: int) -> SandboxError:
        return SandboxError(
            f"path {path!r}: {size} bytes, over read_file's cap of {self.max_read_bytes} bytes "
            "(max_read_bytes in the provider's config)"
        )

    async def write(self, path: str, data: bytes | str) -> None:
        inner = self.inner(path)
        payload = data.encode() if isinstance(data, str) else bytes(data)
        if inner.startswith("/tmp/"):  # tmpfs: the archive API cannot see it; go through a shell
            argv = ["/bin/sh", "-c", _WRITE_TMP, "sh", inner]
            out = await self.run(argv, env={}, cwd="/", stdin=payload, timeout=60, cap=1 << 16, user="0")
            if out.raw.returncode != 0:
                raise SandboxError(
                    f"path {path!r}: write failed: {out.raw.stderr.decode(errors='replace')[-300:]}"
                )
            return
        archive = _one_file_tar(posixpath.relpath(inner, self.workdir), payload)
        try:
            ok = await anyio.to_thread.run_sync(
                self.api.put_archive, self.container_id, self.workdir, archive
            )
        except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as e:
            raise await self.explain(e, f"write_file({path!r})") from e
        if not ok:
            raise SandboxError(
                f"sandbox {self.sandbox_id}: write_file({path!r}): the engine refused the archive"
            )

    async def read(self, path: str) -> bytes:
        inner = self.inner(path)
        if inner.startswith("/tmp/"):
            return await self._read_tmp(path, inner)
        try:
            return await anyio.to_thread.run_sync(self._get, path, inner)
        except docker.errors.NotFound as e:
            raise SandboxError(f"path {path!r}: no such file in the sandbox") from e
        except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as e:
            raise await self.explain(e, f"read_file({path!r})") from e

    async def _read_tmp(self, path: str, inner: str) -> bytes:
        cap = self.max_read_bytes
        argv = ["/bin/sh", "-c", _READ_TMP, "sh", inner, str(cap)]
        out = await self.run(argv, env={}, cwd="/", stdin=None, timeout=60, cap=cap + 1, user="0")
        if out.raw.returncode == 3:
            raise self.too_big(path, int(out.raw.stderr.split()[-1] or 0))
        if out.raw.returncode != 0:
            raise SandboxError(f"path {path!r}: no such regular file in the sandbox")
        if len(out.raw.stdout) > cap:  # it grew after the size check
            raise self.too_big(path, len(out.raw.stdout))
        return out.raw.stdout

    def _get(self, path: str, inner: str) -> bytes:
        """The archive API's read of one workspace file (blocking)."""
        cap, api = self.max_read_bytes, self.api
        # The size first (a HEAD of the archive endpoint), so a huge file is never streamed.
        head = api.head(api._url("/containers/{0}/archive", self.container_id), params={"path": inner})
        api._raise_for_status(head)
        info = docker.utils.decode_json_header(head.headers["X-Docker-Container-Path-Stat"])
        if int(info.get("size", 0)) > cap:
            raise self.too_big(path, int(info["size"]))
        stream, _ = api.get_archive(self.container_id, inner)
        buf = bytearray()
        for chunk in stream:
            buf += chunk
            if len(buf) > cap + _TAR_SLACK:
                raise self.too_big(path, len(buf))
        with tarfile.open(fileobj=io.BytesIO(bytes(buf))) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise SandboxError(f"path {path!r}: not a regular file")
            if member.size > cap:
                raise self.too_big(path, member.size)
            f = tar.extractfile(member)
            assert f is not None
            return f.read()
