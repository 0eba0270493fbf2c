"""LocalSandboxProvider: builds LocalSandbox instances over bubblewrap.

Lifecycle of create(spec): validate the spec, take a prepared slot (or prepare
one now: `<root>/<id>/{work,tmp,run}`, the pids cgroup if possible, and with
`prestart` a Spare bwrap joining it), place spec.files, and precompute the bwrap
and limit argv prefixes so that each exec is one spawn. If any step fails,
whatever was made is removed before the error propagates.

Warm slots: after the first create, up to `config.warm` slots are kept prepared;
sandboxes refill them while their commands run (the refill overlaps a command,
never a create). They are removed by `aclose()`, or at garbage collection / exit.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

import anyio

from miles_env.errors import ConfigError, SandboxError, SandboxUnavailable
from miles_env.types import NetworkPolicy, Resources, SandboxSpec

from .cgroup import PidsCgroup
from .config import LocalSandboxConfig, find_bwrap, host_root_binds
from .sandbox import LocalSandbox
from .spare import Spare, drop_spare, drop_spare_now, start_spare

__all__ = ["LocalSandboxProvider"]


def _limit_prefix(res: Resources, cgroup: PidsCgroup | None, prlimit: str) -> list[str]:
    """argv that joins the cgroup and sets rlimits in one shell, then execs bwrap (no extra fork).

    The shell writes its own pid into cgroup.procs before exec'ing bwrap, so
    every descendant is counted. ulimit units are POSIX (-f in 512-byte blocks)
    or shared by dash and bash (-v in KiB, -t in seconds). CPU soft < hard: the
    kernel sends SIGXCPU first, which tells the cause apart from our SIGKILL.
    """
    steps = []
    if cgroup is not None:
        steps.append('echo $$ > "$0"')
    steps += [
        f"ulimit -S -t {res.cpu_seconds}",
        f"ulimit -H -t {res.cpu_seconds + 1}",
        f"ulimit -v {res.memory_mb << 10}",
        f"ulimit -f {res.disk_mb << 11}",
        "ulimit -c 0",
    ]
    script = " && ".join(steps) + ' || exit 125; exec "$@"'
    prefix = ["/bin/sh", "-c", script, cgroup.procs_file if cgroup is not None else "sh"]
    if cgroup is None:
        # Without a pids cgroup, RLIMIT_NPROC is the fallback (it does not bind root).
        prefix += [prlimit, f"--nproc={res.max_procs}:{res.max_procs}", "--"]
    return prefix


_log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Slot:
    """A sandbox's host-side parts, prepared before its spec is known."""

    sandbox_id: str
    host_dir: Path
    cgroup: PidsCgroup | None
    spare: Spare | None


def _dispose(slots: list[_Slot]) -> None:
    """Synchronous clean-up of unused slots (finalizer / interpreter exit)."""
    while slots:
        slot = slots.pop()
        if slot.spare is not None:
            drop_spare_now(slot.spare)
        if slot.cgroup is not None:
            slot.cgroup.remove()
        shutil.rmtree(slot.host_dir, ignore_errors=True)


class LocalSandboxProvider:
    """SandboxProvider "local": bubblewrap sandboxes on this host."""

    name = "local"

    def __init__(self, config: LocalSandboxConfig | None = None) -> None:
        self.config = config or LocalSandboxConfig()
        self.bwrap = find_bwrap(self.config.bwrap)
        prlimit = shutil.which("prlimit")
        if prlimit is None:
            raise SandboxUnavailable("`prlimit` (util-linux) not found on PATH; the local sandbox needs it")
        self._prlimit = prlimit
        self.root = self.config.resolved_root()
        self._warm: list[_Slot] = []
        self._refilling = False
        weakref.finalize(self, _dispose, self._warm)

    def _bwrap_prefix(self, spec: SandboxSpec, host_dir: Path) -> list[str]:
        args = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session"]
        args += ["--hostname", self.config.hostname]
        if spec.rootfs is not None:
            args += ["--bind", spec.rootfs, "/"]
        else:
            args += host_root_binds(self.config.extra_ro_binds)
        args += ["--bind", str(host_dir / "work"), spec.workdir, "--bind", str(host_dir / "tmp"), "/tmp"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        # The root itself (bwrap's tmpfs, or the rootfs) is read-only: writes go to the binds only.
        return args + ["--remount-ro", "/", "--clearenv"]

    def _validate(self, spec: SandboxSpec) -> None:
        if not spec.workdir.startswith("/") or spec.workdir.rstrip("/") in ("", "/tmp", "/proc", "/dev"):
            raise ConfigError(
                f"SandboxSpec.workdir={spec.workdir!r}: must be an absolute, dedicated directory"
            )
        if spec.rootfs is not None and not os.path.isdir(spec.rootfs):
            raise ConfigError(f"SandboxSpec.rootfs={spec.rootfs!r}: not a directory on the host")
        if spec.network is NetworkPolicy.HOST:
            raise ConfigError("SandboxSpec.network='host' is not supported by the local provider")

    async def _prepare(self, max_procs: int) -> _Slot:
        sandbox_id = secrets.token_hex(6)
        host_dir = self.root / sandbox_id
        slot = _Slot(sandbox_id, host_dir, None, None)
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            host_dir.mkdir(mode=0o700)
            for sub in ("work", "tmp", "run"):
                (host_dir / sub).mkdir(mode=0o755)
            os.chmod(host_dir / "tmp", 0o1777)
            if self.config.use_cgroup:
                slot.cgroup = PidsCgroup.create(f"miles-env-{sandbox_id}", max_procs)
            if self.config.prestart:
                slot.spare = start_spare(self.bwrap, (), slot.cgroup, set())
        except BaseException as e:
            _dispose([slot])
            if isinstance(e, OSError):
                raise SandboxError(f"creating sandbox under {self.root}: {e}") from e
            raise
        return slot

    async def _refill(self) -> None:
        """Top the warm slots up to config.warm; a failure here only costs speed, so it is logged."""
        if self._refilling:
            return
        self._refilling = True
        try:
            while len(self._warm) < self.config.warm:
                self._warm.append(await self._prepare(Resources().max_procs))
        except Exception as e:  # the next create() prepares its own slot and reports the error
            _log.warning("local sandbox: preparing a warm slot failed: %s", e)
        finally:
            self._refilling = False

    def _take_warm(self) -> _Slot | None:
        while self._warm:
            slot = self._warm.pop()
            if (slot.host_dir / "work").is_dir():
                return slot
            _dispose([slot])  # removed behind our back (e.g. `sandbox gc` after a long idle)
        return None

    async def create(self, spec: SandboxSpec) -> LocalSandbox:
        if not isinstance(spec, SandboxSpec):
            raise ConfigError(f"create(spec): expected a SandboxSpec, got {type(spec).__name__}")
        self._validate(spec)
        slot = self._take_warm() or await self._prepare(spec.resources.max_procs)
        sandbox = LocalSandbox(
            sandbox_id=slot.sandbox_id,
            spec=spec,
            host_dir=slot.host_dir,
            bwrap_prefix=self._bwrap_prefix(spec, slot.host_dir),
            limit_prefix=_limit_prefix(spec.resources, slot.cgroup, self._prlimit),
            cgroup=slot.cgroup,
            python=self.config.python,
            spare=slot.spare,
            prestart=self.config.prestart,
            after_exec=self._refill if self.config.warm else None,
        )
        try:
            if slot.cgroup is not None and spec.resources.max_procs != Resources().max_procs:
                slot.cgroup.set_max(spec.resources.max_procs)
            for path, text in spec.files.items():
                await sandbox.write_file(path, text)
        except BaseException as e:
            await sandbox.close()
            if isinstance(e, OSError):
                raise SandboxError(f"creating sandbox under {self.root}: {e}") from e
            raise
        return sandbox

    async def aclose(self) -> None:
        """Remove the warm slots (sandboxes already handed out are closed by their owners)."""
        with anyio.CancelScope(shield=True):
            while self._warm:
                slot = self._warm.pop()
                if slot.spare is not None:
                    spare, slot.spare = slot.spare, None
                    await drop_spare(spare, set())
                _dispose([slot])
