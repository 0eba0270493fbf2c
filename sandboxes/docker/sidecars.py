"""Sidecar containers beside a DockerSandbox (miles_env.sandbox.RunsSidecars): a task's compose services.

Concept: a sidecar is a container of its own image (built from its context, or from `FROM image`,
by the provider's builder, so bases resolve as the task's own do: mirror, registry, bootstrap,
alias) that shares the sandbox container's network namespace, so it has the sandbox's network
policy (none by default: the two talk over loopback, nothing else); its name resolves to
127.0.0.1 in the sandbox (a line in the container's hosts file, written from the host side).
A healthcheck (compose's `test`: ["CMD", ...], ["CMD-SHELL", "..."] or a string) is polled
until it passes; without one the sidecar need only be running.

Invariant: a sidecar carries the sandbox's ownership labels (the reaper removes it with them)
and is removed before the sandbox's own container; the same memory and process limits apply.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import docker.errors

from miles_env.errors import SandboxError

__all__ = ["health_argv", "run_sidecar"]


def health_argv(test: list[str] | str | None) -> list[str] | None:
    """compose healthcheck `test` -> an exec argv (None: no check)."""
    if test is None or test == ["NONE"]:
        return None
    if isinstance(test, str):
        return ["sh", "-c", test]
    if test[:1] == ["CMD"]:
        return list(test[1:])
    if test[:1] == ["CMD-SHELL"]:
        return ["sh", "-c", " ".join(test[1:])]
    return list(test)


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


def _wait_healthy(api: Any, cid: str, argv: list[str] | None, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        state = api.inspect_container(cid)["State"]
        if not state.get("Running"):
            logs = api.logs(cid, tail=20).decode(errors="replace").strip()
            raise SandboxError(f"sidecar {name!r} exited ({state.get('ExitCode')}): {logs[-500:]}")
        if argv is None:
            return
        ex = api.exec_create(cid, argv)
        last = api.exec_start(ex["Id"]).decode(errors="replace").strip()
        if api.exec_inspect(ex["Id"])["ExitCode"] == 0:
            return
        time.sleep(1.0)
    raise SandboxError(f"sidecar {name!r}: not healthy after {timeout:g}s (last check: {last[-300:]!r})")


def run_sidecar(
    client: Any, builder: Any, main_id: str, name: str, *, image: str | None, build: str | None,
    dockerfile: str | None, env: Mapping[str, str], command: list[str] | str | None,
    healthcheck: list[str] | str | None, timeout: float,
) -> str:  # fmt: skip
    """Start sidecar `name` in container `main_id`'s network namespace; its container id (blocking)."""
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
    _wait_healthy(api, c.id, health_argv(healthcheck), name, timeout)
    return str(c.id)
