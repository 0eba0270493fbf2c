"""A build, planned: its bases resolved, its cache key, and the Dockerfile the builder gets.

Concept: both builders (buildah for the local provider, dockerd for the docker one) build the
same way: resolve every image the Dockerfile pulls (resolve.py), key the build on the builder,
the Dockerfile, every file of the context (path, mode, bytes; symlinks by target) and each
base's digest and substitute recipe, then hand the builder the Dockerfile with its images
pointed at the local names of the resolved bases and BuildKit's here-documents lowered
(dockerfile.py). The key changes exactly when one of those does; equal keys are one build.

`lock(path)` is the cross-process (and cross-thread) mutex that makes concurrent builds of the
same key one build: an flock on a file per key.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from miles_env.errors import ConfigError

from .dockerfile import parse_dockerfile
from .resolve import ResolvedImage, Resolver

__all__ = ["BuildPlan", "plan_build", "context_digest", "lock"]

_DIGESTS: dict[tuple[object, ...], str] = {}
_DIGESTS_LOCK = threading.Lock()


def _walk(root: Path) -> list[tuple[str, os.stat_result]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            path = os.path.join(dirpath, name)
            out.append((os.path.relpath(path, root), os.lstat(path)))
    return out


def context_digest(root: Path) -> str:
    """sha256 over the context's files: path, mode, then bytes or symlink target.

    Kept per process by the files' (path, mode, size, mtime) signature, so an unchanged context
    is read once."""
    entries = _walk(root)
    sig = (str(root), tuple((rel, st.st_mode, st.st_size, st.st_mtime_ns) for rel, st in entries))
    with _DIGESTS_LOCK:
        if sig in _DIGESTS:
            return _DIGESTS[sig]
    h = hashlib.sha256()
    for rel, st in entries:
        h.update(f"{rel}\0{stat.S_IMODE(st.st_mode)}\0".encode())
        path = root / rel
        if stat.S_ISLNK(st.st_mode):
            h.update(b"L" + os.readlink(path).encode())
        elif stat.S_ISREG(st.st_mode):
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        h.update(b"\0")
    digest = h.hexdigest()
    with _DIGESTS_LOCK:
        _DIGESTS[sig] = digest
    return digest


@dataclass(slots=True)
class BuildPlan:
    key: str  # hex sha256: equal keys are one build
    bases: tuple[ResolvedImage, ...]
    dockerfile: str  # lowered, images pointed at local names
    context: Path  # the task's context, or a temporary copy with the here-document files added
    source: Path  # the task's Dockerfile, for messages
    _temp: Path | None = field(default=None, repr=False)

    def write_dockerfile(self, path: Path) -> Path:
        path.write_text(self.dockerfile)
        return path

    def cleanup(self) -> None:
        if self._temp is not None:
            shutil.rmtree(self._temp, ignore_errors=True)
            self._temp = None


def plan_build(
    context: Path,
    resolver: Resolver,
    builder_id: str,
    local_name: Callable[[ResolvedImage], str],
    dockerfile_text: str | None = None,
) -> BuildPlan:
    """Resolve, key and lower the build of `context` (its Dockerfile, unless text is given)."""
    source = context / "Dockerfile"
    if dockerfile_text is None:
        try:
            dockerfile_text = source.read_text()
        except OSError as e:
            raise ConfigError(f"SandboxSpec.build={str(context)!r}: no readable Dockerfile ({e})") from e
    df = parse_dockerfile(dockerfile_text)
    images = df.external_images()
    bases = tuple(resolver.resolve(image) for image in images)
    h = hashlib.sha256(f"{builder_id}\0{dockerfile_text}\0{context_digest(context)}\0".encode())
    for base in bases:
        h.update(f"{base.requested}={base.key}\0".encode())
    df.point_images({image: local_name(base) for image, base in zip(images, bases, strict=True)})
    extra = df.lower()
    plan = BuildPlan(h.hexdigest(), bases, df.render(), context, source)
    if extra:
        temp = Path(tempfile.mkdtemp(prefix="miles-env-context-"))
        shutil.copytree(context, temp / "ctx", symlinks=True)
        for rel, data in extra.items():
            (temp / "ctx" / rel).parent.mkdir(parents=True, exist_ok=True)
            (temp / "ctx" / rel).write_bytes(data)
        plan.context, plan._temp = temp / "ctx", temp
    return plan


@contextmanager
def lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (made if missing), held for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
