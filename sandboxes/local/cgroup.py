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

CPU: where the cpu controller is writable too (v1: a `cpu` mount, v2: `cpu` in the
same subtree_control), the same cgroup (v2) or a twin of the same name under the cpu
mount (v1) carries the task's `Resources.cpus` as a CFS quota (`cpu.max`, or
`cpu.cfs_quota_us`/`cpu.cfs_period_us`), set again each time a zygote is reused.
Every process joins both (`procs_files`). Memory stays an rlimit (RLIMIT_AS): a
memory cgroup would also charge the sandbox's tmpfs, which is `disk_mb`'s to cap.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

__all__ = ["PidsCgroup", "pids_base", "cpu_base", "remove_orphan_zygote_cgroups"]

_CFS_PERIOD_US = 100_000


def pids_base() -> str | None:
    """The directory of our own cgroup in the pids hierarchy, if any."""
    return _base("pids")


def cpu_base() -> str | None:
    """The directory of our own cgroup in the cpu hierarchy, if any."""
    return _base("cpu")


def _base(controller: str) -> str | None:
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
    mount = f"/sys/fs/cgroup/{controller}"
    if controller in v1 and os.path.isdir(mount):
        return os.path.join(mount, v1[controller].lstrip("/"))
    if v2 is not None and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        base = os.path.join("/sys/fs/cgroup", v2.lstrip("/"))
        try:
            with open(os.path.join(base, "cgroup.subtree_control")) as f:
                if controller in f.read().split():
                    return base
        except OSError:
            return None
    return None


@dataclass(slots=True)
class PidsCgroup:
    path: str
    cpu_path: str | None = None  # where the CPU quota is written (== path on cgroup v2), if anywhere

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
        cgroup = cls(path, _cpu_twin(base, path, name))
        try:
            cgroup.set_max(max_pids)
        except OSError:
            cgroup.remove()
            return None
        return cgroup

    def set_max(self, max_pids: int) -> None:
        with open(os.path.join(self.path, "pids.max"), "w") as f:
            f.write(str(max_pids))

    def set_cpus(self, cpus: float | None) -> bool:
        """Quota of `cpus` cores (None: no quota); False where no cpu controller is ours to write."""
        if self.cpu_path is None:
            return cpus is None
        quota = -1 if cpus is None else max(1000, int(cpus * _CFS_PERIOD_US))
        if os.path.exists(os.path.join(self.cpu_path, "cpu.max")):  # cgroup v2
            value = "max" if quota < 0 else str(quota)
            _write(os.path.join(self.cpu_path, "cpu.max"), f"{value} {_CFS_PERIOD_US}")
        else:
            _write(os.path.join(self.cpu_path, "cpu.cfs_period_us"), str(_CFS_PERIOD_US))
            _write(os.path.join(self.cpu_path, "cpu.cfs_quota_us"), str(quota))
        return True

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    @property
    def procs_files(self) -> list[str]:
        """Every cgroup.procs a member must be written into (pids, and cpu's twin on v1)."""
        files = [self.procs_file]
        if self.cpu_path is not None and self.cpu_path != self.path:
            files.append(os.path.join(self.cpu_path, "cgroup.procs"))
        return files

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
                break
            except FileNotFoundError:
                break
            except OSError:
                # EBUSY while killed processes are still being reaped.
                self.kill_all(0.05)
                time.sleep(0.005)
        if self.cpu_path is not None and self.cpu_path != self.path:
            for _ in range(200):  # its members were the pids cgroup's, killed above
                try:
                    os.rmdir(self.cpu_path)
                    return
                except FileNotFoundError:
                    return
                except OSError:
                    time.sleep(0.005)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _cpu_twin(pids_base_dir: str, pids_path: str, name: str) -> str | None:
    """The cgroup that carries the CPU quota: the pids one on v2 (cpu enabled), a twin on v1."""
    base = cpu_base()
    if base is None:
        return None
    if base == pids_base_dir:  # v2: one hierarchy, cpu enabled in the same subtree_control
        return pids_path
    path = os.path.join(base, name)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    except OSError:
        return None
    return path


def remove_orphan_zygote_cgroups(min_age_s: float = 60.0) -> None:
    """Remove empty `miles-env-z*` cgroups: their zygote is gone (it exits with its provider's process).

    A live zygote is always inside its cgroup, so rmdir (which refuses a populated cgroup) cannot
    hit one; the age guard skips a cgroup made a moment ago whose zygote has not joined yet.
    """
    for base in {pids_base(), cpu_base()}:  # the cpu twins too (cgroup v1)
        if base is None or not os.path.isdir(base):
            continue
        for name in os.listdir(base):
            path = os.path.join(base, name)
            if not name.startswith("miles-env-z") or not os.path.isdir(path):
                continue
            try:
                if time.time() - os.stat(path).st_mtime > min_age_s:
                    os.rmdir(path)
            except OSError:
                pass  # populated (a live zygote) or already gone
