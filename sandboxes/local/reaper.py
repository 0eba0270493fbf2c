"""The local provider's reaper: workspaces, pids cgroups and tmpfs mounts left by crashed runs.

Concept: a local sandbox handed out by a SandboxPool has `<root>/<id>/owner.json`
with the ownership labels (ownership.py); a workspace whose owner is dead (or,
without the file, whose age passed the TTL) is stale. Its processes are killed
(its bwrap, found by the sandbox's paths on its command line, is the init of the sandbox's pid
namespace: killing it ends every process inside), its directory and its pids cgroup removed; then empty zygote cgroups, and (as root) every sandbox tmpfs whose
workspace is gone, so a crashed run's RAM comes back now rather than when the next
local provider starts. Reached as `LocalSandboxProvider.reap()` (the Reapable
capability), like every other provider's reaper.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

from ..ownership import DEFAULT_TTL_S, is_stale
from .cgroup import PidsCgroup, pids_base, remove_orphan_zygote_cgroups
from .storage import remove_orphan_mounts

__all__ = ["reap_local"]


def _kill_by_cmdline(marker: str) -> None:
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


def reap_local(root: Path, ttl_s: float | None = None, mount_dir: Path | None = None) -> list[str]:
    """Remove stale local workspaces under `root` and their pids cgroups.

    `mount_dir` is the provider's (as root, where each sandbox's tmpfs is mounted; None without
    root): the mounts there whose workspace no longer exists are detached and their points removed.
    """
    removed: list[str] = []
    if root.is_dir():
        for d in root.iterdir():
            if not d.is_dir():
                continue
            try:
                labels = json.loads((d / "owner.json").read_text())
                stale = is_stale(labels, ttl_s)
            except (OSError, ValueError):
                stale = time.time() - d.stat().st_mtime > (ttl_s if ttl_s is not None else DEFAULT_TTL_S)
            if stale:
                _kill_by_cmdline(str(d))
                if mount_dir is not None:
                    _kill_by_cmdline(str(mount_dir / d.name) + "/")
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d.name)
    # Only the cgroups of workspaces removed here: others may belong to live sandboxes of other roots.
    base = pids_base()
    for sid in removed:
        path = os.path.join(base, f"miles-env-{sid}") if base else None
        if path and os.path.isdir(path):
            cg = PidsCgroup(path)
            cg.kill_all(1.0)
            cg.remove()
    remove_orphan_zygote_cgroups()
    if mount_dir is not None and mount_dir.is_dir():
        remove_orphan_mounts(mount_dir)  # also those of workspaces an earlier sweep removed
    return sorted(removed)
