"""Sidecar containers beside a DockerSandbox (miles_env.sandbox.RunsSidecars): a task's compose services.

Concept: a sidecar is a container of its own image (built from its context, or from `FROM image`,
by the provider's builder, so bases resolve as the task's own do: mirror, registry, bootstrap,
alias) that shares the sandbox container's network namespace, so it has the sandbox's network
policy (none by default: the two talk over loopback, nothing else); its name resolves to
127.0.0.1 in the sandbox (a line in the container's hosts file, written from the host side).
A healthcheck (compose's `test`: ["CMD", ...], ["CMD-SHELL", "..."] or a string) is polled
until it passes (sandboxes/health.py, shared with the local provider); without one the sidecar
need only be running.

Invariant: a sidecar carries the sandbox's ownership labels (the reaper removes it with them)
and is removed before the sandbox's own container; the same memory and process limits apply.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import docker.errors

from miles_env.errors import SandboxError

from ..health import wait_healthy

__all__ = ["run_sidecar", "wait_sidecar"]


def _image(builder: Any, image: str | None, build: str | None, dockerfile: str | None) -> str:
    if dockerfile not in (None, "Dockerfile"):
        raise SandboxError(f"sidecar build dockerfile={dockerfile!r}: only the context's Dockerfile is built")
    if build is not None:
        tag, _ = builder.build(Path(build))
        return str(tag)
    if image is None:
        raise SandboxError("a sidecar needs an image or a build context")
    with tempfile.TemporaryDirectory(prefix="miles-env-sidecar-") as ctx:  # resolved like any FROM
        (Path(ctx) / "Dockerfile").write_text(f"FROM {image}\n")
        tag, _ = builder.build(Path(ctx))
    return str(tag)


async def wait_sidecar(
    api: Any, cid: str, name: str, healthcheck: list[str] | str | None, timeout: float
) -> None:
    """Until sidecar container `cid` is healthy (sandboxes/health.py), its probes run in threads."""

    def exited() -> str | None:
        state = api.inspect_container(cid)["State"]
        if state.get("Running"):
            return None
        logs = api.logs(cid, tail=20).decode(errors="replace").strip()
        return f"({state.get('ExitCode')}): {logs[-500:]}"

    def check(argv: list[str]) -> tuple[bool, str]:
        ex = api.exec_create(cid, argv)
        out = api.exec_start(ex["Id"]).decode(errors="replace").strip()
        return api.exec_inspect(ex["Id"])["ExitCode"] == 0, out

    async def exited_async() -> str | None:
        return await anyio.to_thread.run_sync(exited)

    async def check_async(argv: list[str]) -> tuple[bool, str]:
        return await anyio.to_thread.run_sync(check, argv)

    await wait_healthy(name, healthcheck, exited=exited_async, check=check_async, timeout=timeout)


def run_sidecar(
    client: Any, builder: Any, main_id: str, name: str, *, image: str | None, build: str | None,
    dockerfile: str | None, env: Mapping[str, str], command: list[str] | str | None,
) -> str:  # fmt: skip
    """Start sidecar `name` in container `main_id`'s network namespace; its container id (blocking;
    `wait_sidecar` then waits for its healthcheck)."""
    api = client.api
    main = api.inspect_container(main_id)
    host = main["HostConfig"]
    tag = _image(builder, image, build, dockerfile)
    labels = dict(main["Config"].get("Labels") or {})
    try:
        c = client.containers.run(
            tag, command=command, detach=True, name=f"{main['Name'].lstrip('/')}-{name}", labels=labels,
            environment=dict(env), network_mode=f"container:{main_id}", init=True,
            mem_limit=host.get("Memory") or None, pids_limit=host.get("PidsLimit") or None,
            security_opt=["no-new-privileges"],
        )  # fmt: skip
    except docker.errors.DockerException as e:
        raise SandboxError(f"sidecar {name!r}: {e}") from e
    hosts = main.get("HostsPath")
    if hosts:
        with open(hosts, "a") as f:  # the engine's file for this container, on this host
            f.write(f"127.0.0.1\t{name}\n")
    return str(c.id)
