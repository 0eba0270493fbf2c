"""A per-sandbox pids (and accounting) cgroup, when the host lets us create one.

Why: RLIMIT_NPROC counts per user id and exempts root, and the sandbox runs as
host root in its own user namespace, so only a pids cgroup really contains a
fork bomb. Lifecycle: `PidsCgroup.create()` makes `<pids mount>/<own cgroup>/
miles-env-<id>` with pids.max; every exec joins it before starting bwrap (the
wrapper shell writes its pid into cgroup.procs, then execs bwrap, so nothing
escapes); `kill_all()` then `remove()` on close. cgroup v1 (a `pids` mount) and
v2 (a delegated subtree with the pids controller) are both handled; when
neither is writable, `create()` returns None and the provider falls back to
RLIMIT_NPROC.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

__all__ = ["PidsCgroup", "pids_base", "remove_orphan_zygote_cgroups"]


def pids_base() -> str | None:
    """The directory of our own cgroup in the pids hierarchy, if any."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v1 = {}
    v2 = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2 = path
        for c in controllers.split(","):
            v1[c] = path
    if "pids" in v1 and os.path.isdir("/sys/fs/cgroup/pids"):
        return os.path.join("/sys/fs/cgroup/pids", v1["pids"].lstrip("/"))
    if v2 is not None and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        base = os.path.join("/sys/fs/cgroup", v2.lstrip("/"))
        try:
            with open(os.path.join(base, "cgroup.subtree_control")) as f:
                if "pids" in f.read().split():
                    return base
        except OSError:
            return None
    return None


@dataclass(slots=True)
class PidsCgroup:
    path: str

    @classmethod
    def create(cls, name: str, max_pids: int) -> PidsCgroup | None:
        base = pids_base()
        if base is None:
            return None
        path = os.path.join(base, name)
        try:
            os.mkdir(path, 0o755)
        except OSError:
            return None
        cgroup = cls(path)
        try:
            cgroup.set_max(max_pids)
        except OSError:
            os.rmdir(path)
            return None
        return cgroup

    def set_max(self, max_pids: int) -> None:
        with open(os.path.join(self.path, "pids.max"), "w") as f:
            f.write(str(max_pids))

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def max_events(self) -> int:
        """How often a fork was refused because pids.max was reached."""
        try:
            with open(os.path.join(self.path, "pids.events")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "max":
                        return int(value)
        except OSError:
            pass
        return 0

    def pids(self) -> list[int]:
        try:
            with open(self.procs_file) as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def kill_all(self, deadline_s: float = 5.0) -> None:
        # Repeat: a process may fork between our read and our kill.
        end = time.monotonic() + deadline_s
        while (pids := self.pids()) and time.monotonic() < end:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)

    def remove(self) -> None:
        for _ in range(200):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                # EBUSY while killed processes are still being reaped.
                self.kill_all(0.05)
                time.sleep(0.005)


def remove_orphan_zygote_cgroups(min_age_s: float = 60.0) -> None:
    """Remove empty `miles-env-z*` cgroups: their zygote is gone (it exits with its provider's process).

    A live zygote is always inside its cgroup, so rmdir (which refuses a populated cgroup) cannot
    hit one; the age guard skips a cgroup made a moment ago whose zygote has not joined yet.
    """
    base = pids_base()
    if base is None or not os.path.isdir(base):
        return
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if not name.startswith("miles-env-z") or not os.path.isdir(path):
            continue
        try:
            if time.time() - os.stat(path).st_mtime > min_age_s:
                os.rmdir(path)
        except OSError:
            pass  # populated (a live zygote) or already gone
