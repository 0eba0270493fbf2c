"""LocalSandboxProvider: builds LocalSandbox instances over bubblewrap.

Lifecycle of create(spec): validate the spec, make `<root>/<id>/{work,tmp,run}`
(mode 0700), take an idle zygote with its pids cgroup (or start one: the only
cgroup join, zygote.py says why that matters), place spec.files, and precompute
the bwrap argv so that each exec is one fork. If any step fails, whatever was
made is removed before the error propagates.

Reuse: a closed sandbox hands back its zygote and cgroup once nothing else is left
in the cgroup; up to `config.warm` of them stay idle for the next create. They are
removed by `aclose()`, or at garbage collection / interpreter exit.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import weakref
from pathlib import Path

from miles_env.errors import ConfigError, SandboxError, SandboxUnavailable
from miles_env.types import NetworkPolicy, Resources, SandboxSpec

from .cgroup import PidsCgroup, remove_orphan_zygote_cgroups
from .config import LocalSandboxConfig, find_bwrap, host_root_binds
from .forkserver import Zygote, start_zygote
from .sandbox import LocalSandbox

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


def _dispose(idle: list[tuple[Zygote, PidsCgroup]]) -> None:
    """Synchronous clean-up of idle zygotes and their cgroups (aclose, finalizer, exit)."""
    while idle:
        zygote, cgroup = idle.pop()
        zygote.close()
        cgroup.remove()


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
        self._idle: list[tuple[Zygote, PidsCgroup]] = []
        if self.config.use_cgroup:
            remove_orphan_zygote_cgroups()  # what killed runs left: empty cgroups, a few ms at most
        weakref.finalize(self, _dispose, self._idle)

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

    def _zygote(self, sandbox_id: str, max_procs: int) -> tuple[Zygote | None, PidsCgroup | None]:
        """An idle zygote and its cgroup, or new ones; (None, None) where no cgroup can be made."""
        if not self.config.use_cgroup:
            return None, None
        while self._idle:
            zygote, cgroup = self._idle.pop()
            if zygote.process.poll() is None:
                break
            cgroup.remove()  # the zygote died while idle
        else:
            made = PidsCgroup.create(f"miles-env-z{sandbox_id}", max_procs + 1)
            if made is None:
                return None, None
            zygote, cgroup = start_zygote(sys.executable, made), made
        cgroup.set_max(max_procs + 1)  # + the zygote itself
        return zygote, cgroup

    def _give_back(self, zygote: Zygote, cgroup: PidsCgroup) -> None:
        if len(self._idle) < self.config.warm:
            self._idle.append((zygote, cgroup))
        else:
            _dispose([(zygote, cgroup)])

    async def create(self, spec: SandboxSpec) -> LocalSandbox:
        if not isinstance(spec, SandboxSpec):
            raise ConfigError(f"create(spec): expected a SandboxSpec, got {type(spec).__name__}")
        self._validate(spec)
        sandbox_id = secrets.token_hex(6)
        host_dir = self.root / sandbox_id
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            host_dir.mkdir(mode=0o700)
            for sub in ("work", "tmp", "run"):
                (host_dir / sub).mkdir(mode=0o755)
            os.chmod(host_dir / "tmp", 0o1777)
            zygote, cgroup = self._zygote(sandbox_id, spec.resources.max_procs)
        except OSError as e:
            shutil.rmtree(host_dir, ignore_errors=True)
            raise SandboxError(f"creating sandbox under {self.root}: {e}") from e
        sandbox = LocalSandbox(
            sandbox_id=sandbox_id,
            spec=spec,
            host_dir=host_dir,
            bwrap_prefix=self._bwrap_prefix(spec, host_dir),
            limit_prefix=_limit_prefix(spec.resources, cgroup, self._prlimit),
            cgroup=cgroup,
            python=self.config.python,
            zygote=zygote,
            on_close=self._give_back,
        )
        try:
            for path, text in spec.files.items():
                await sandbox.write_file(path, text)
        except BaseException as e:
            await sandbox.close()
            if isinstance(e, OSError):
                raise SandboxError(f"creating sandbox under {self.root}: {e}") from e
            raise
        return sandbox

    async def aclose(self) -> None:
        """Stop the idle zygotes and remove their cgroups (open sandboxes are their owners' to close)."""
        _dispose(self._idle)
