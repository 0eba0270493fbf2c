"""Compose sidecars beside a local sandbox (miles_env.sandbox.RunsSidecars): a task's other services.

Concept: as on docker (sandboxes/docker/sidecars.py), a sidecar is a container of its own image
that shares the task sandbox's network namespace. Here it is a local sandbox of its own, made by
the same provider the same way (provider.py): its image built and unpacked by buildah (so bases
resolve as the task's own do), its own zygote, user namespace pair and random host id range,
pids cgroup, mount/pid/ipc/uts namespaces, and writable layer on its own `disk_mb` tmpfs, with the
task sandbox's Resources. Only the network namespace is not its own: its zygote joins the task
sandbox's (as host root, the one allowed to: `Zygote.netns()`, then bwrap without --unshare-net),
so `localhost:PORT` and the service's name (a line in /etc/hosts, as docker writes one) reach it
from the task sandbox, and it has the task sandbox's network policy: loopback only under `none`,
slirp4netns's `eth0` under `public`. Its command is compose's: the image's ENTRYPOINT with the
service's `command` or else the image's CMD, in the background with its output in its own /tmp
(a file, on its quota), as the image's USER with its ENV and the service's environment; its
healthcheck is waited on as docker's (sandboxes/health.py).

Invariants: nothing of the task sandbox is in a sidecar but the network namespace (it cannot see
the task's files or processes, nor they its); a sidecar is closed before its task sandbox, with
everything it started and its files, and like any local sandbox nothing of it outlives a killed
run (its zygote stops it at EOF); it carries its task sandbox's ownership labels for the reaper.
Root only: without root, another sandbox's network namespace cannot be joined (the provider says
so).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from miles_env.errors import SandboxError
from miles_env.sandbox import Command
from miles_env.types import ExecResult, NetworkPolicy, SandboxSpec

from ..health import wait_healthy
from ..images.oci import ImageConfig
from .forkserver import ZygoteChild

__all__ = ["Sidecar", "add_host", "share_owner", "sidecar_argv", "sidecar_spec"]

WORKDIR = "/.miles-env-work"  # a sidecar has no task workspace; its image's files stay as they are
LOG = "/tmp/.miles-env-sidecar.log"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")  # compose's service names, and a hostname


class _Host(Protocol):
    """The part of LocalSandbox a sidecar uses (no import of sandbox.py: it imports us)."""

    image_config: ImageConfig | None

    def start_child(
        self, cmd: Command, *, cwd: str | None, env: Mapping[str, str] | None, timeout: float | None = None
    ) -> tuple[ZygoteChild, float]: ...

    async def exec(self, cmd: Command, *, timeout: float | None = None) -> ExecResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def close(self) -> None: ...


def sidecar_spec(
    main: SandboxSpec, name: str, image: str | None, build: str | None, dockerfile: str | None,
    env: Mapping[str, str] | None,
) -> SandboxSpec:  # fmt: skip
    """The sidecar's own SandboxSpec: its image, the task sandbox's Resources, the service's env."""
    if not _NAME.fullmatch(name):
        raise SandboxError(f"sidecar {name!r}: not a service name compose would accept")
    if dockerfile not in (None, "Dockerfile"):
        raise SandboxError(f"sidecar build dockerfile={dockerfile!r}: only the context's Dockerfile is built")
    if build is None and image is None:
        raise SandboxError("a sidecar needs an image or a build context")
    return SandboxSpec(
        image=image if build is None else None, build=build, env=dict(env or {}), workdir=WORKDIR,
        resources=main.resources, network=NetworkPolicy.NONE,  # none of its own: it joins the task's
    )  # fmt: skip


def sidecar_argv(name: str, config: ImageConfig | None, command: list[str] | str | None) -> list[str]:
    """What compose runs: ENTRYPOINT + (`command`, a string split as compose splits it, or CMD),
    with its output to LOG."""
    config = config or ImageConfig()
    if command is None:
        args = list(config.cmd)
    else:
        args = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    argv = [*config.entrypoint, *args]
    if not argv:
        raise SandboxError(f"sidecar {name!r}: its image has no ENTRYPOINT or CMD and its service no command")
    return ["/bin/sh", "-c", f'exec "$@" </dev/null >>{LOG} 2>&1', "miles-env-sidecar", *argv]


def share_owner(main_dir: Path, sidecar_dir: Path) -> None:
    """The task sandbox's ownership labels (the pool's owner.json), so the reaper judges a sidecar
    by its task sandbox's owner and TTL, as docker's carries its container's labels."""
    owner = main_dir / "owner.json"
    if owner.is_file():
        (sidecar_dir / "owner.json").write_bytes(owner.read_bytes())


def add_host(hosts: Path, name: str) -> None:
    """`name` -> 127.0.0.1 in a sandbox's /etc/hosts (its host-side file; never through a link)."""
    fd = os.open(hosts, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.write(fd, f"127.0.0.1\t{name}\n".encode())
    finally:
        os.close(fd)


@dataclass(slots=True)
class Sidecar:
    """A running sidecar: its sandbox and the command compose would have started in it."""

    name: str
    sandbox: _Host
    child: ZygoteChild

    @classmethod
    def start(cls, name: str, sandbox: _Host, command: list[str] | str | None) -> Sidecar:
        child, _ = sandbox.start_child(sidecar_argv(name, sandbox.image_config, command), cwd=None, env=None)
        for fd in (child.stdin, child.stdout, child.stderr):  # it writes to LOG; stdin is /dev/null
            os.close(fd)
        child.stdin = child.stdout = child.stderr = -1
        return cls(name, sandbox, child)

    async def exited(self) -> str | None:
        """None while its command runs; else its status and the end of its output."""
        code = self.child.exited()
        if code is None:
            return None
        if self.child.error is not None:
            return f"({code}): {self.child.error}"
        try:
            log = (await self.sandbox.read_file(LOG)).decode(errors="replace").strip()
        except SandboxError:
            log = ""
        return f"({code}): {log[-500:] or 'no output'}"

    async def check(self, argv: list[str]) -> tuple[bool, str]:
        r = await self.sandbox.exec(argv, timeout=30)
        return r.exit_code == 0, (r.stdout + r.stderr).strip()

    async def wait_healthy(self, test: list[str] | str | None, timeout: float) -> None:
        await wait_healthy(self.name, test, exited=self.exited, check=self.check, timeout=timeout)

    async def close(self) -> None:
        try:
            await self.sandbox.close()
        finally:
            self.child.close_pipes()
