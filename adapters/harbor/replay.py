"""A Dockerfile's final stage replayed in a sandbox that cannot build images (the local one).

Concept: `run_setup` walks the final stage in order with the state Docker would keep:
the working directory (`WORKDIR`, created, relative to the previous one), the build
environment (`ENV`, and `ARG` defaults, both visible to later steps), the shell for
shell-form `RUN` (`SHELL ["bash", "-c"]`, default `/bin/sh -c`). `COPY`/`ADD` are
copying.py's. `RUN` runs in the exec form as an argv, in the shell form under the
shell; a `RUN <<EOF` whose command is the here-document alone is written to a file
(mode 755) and run by the shell as a path, as BuildKit does (a `#!` line picks the
interpreter); any other here-document RUN is given to the shell with its bodies in
place. Image metadata (`CMD`, `ENTRYPOINT`, `EXPOSE`, `LABEL`, `HEALTHCHECK`,
`VOLUME`, `STOPSIGNAL`, `ONBUILD`, `MAINTAINER`) changes no file and is skipped.

Refused by name, with the line: `RUN --mount/--network/--security`, `USER` other than
root (one user per sandbox), steps needing root or a package index (apt-get
install of packages already present is skipped), any unknown instruction.

Invariant: nothing on the host is written; steps run in Dockerfile order with the
cwd and environment Docker would give them; the first failing step stops the replay.
"""

from __future__ import annotations

import json
import re
import shlex
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_env.adapters.harbor.copying import abs_path, copy_step
from miles_env.adapters.harbor.dockerfile import (
    BASE_ENV,
    Step,
    arg_default,
    env_pairs,
    expand,
    final_stage,
    parse_dockerfile,
    refuse,
    split_flags,
)
from miles_env.errors import TaskError
from miles_env.sandbox import Sandbox

__all__ = ["run_setup"]

_METADATA = {"FROM", "CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "HEALTHCHECK", "VOLUME"}
_METADATA |= {"STOPSIGNAL", "ONBUILD"}
_ROOT_USERS = {"root", "0", "root:root", "0:0"}
# Commands that need root or a package index: not runnable in an unprivileged, offline sandbox.
_ROOT_ONLY = re.compile(
    r"(?:^|[;&|(\n]\s*|\bsudo\s+)(apt|apt-get|aptitude|dpkg|yum|dnf|microdnf|apk|zypper|pacman|"
    r"useradd|adduser|groupadd|addgroup|usermod|chown|chsh|locale-gen|update-alternatives|systemctl)\b"
)
_APT_OK = re.compile(r"^(?:DEBIAN_FRONTEND=\S+\s+)?apt(?:-get)?\s+(update|clean|install|-y|-qq|-q|--\S+|\s)+")


def _apt_satisfied_cmd(cmd: str) -> str | None:
    """For `apt-get update && apt-get install -y a b`, a check that a and b are installed.

    A package counts as installed when dpkg says so or a command of its name exists
    (the local sandbox shows the host's /usr but not its /var/lib/dpkg).
    """
    parts = [p.strip() for p in re.split(r"&&|;", cmd) if p.strip()]
    pkgs: list[str] = []
    for part in parts:
        if part.startswith("rm -rf /var/lib/apt/lists"):
            continue
        if not _APT_OK.match(part + " "):
            return None
        words = part.split()
        if "install" in words:
            pkgs += [w.split("=")[0] for w in words[words.index("install") + 1 :] if not w.startswith("-")]
    if not pkgs:
        return "true"
    checks = [
        f"{{ dpkg-query -W -f='${{Status}}' {q} 2>/dev/null | grep -q 'ok installed' || command -v {q} >/dev/null; }}"
        for q in map(shlex.quote, pkgs)
    ]
    return " && ".join(checks)


async def _installed(sandbox: Sandbox, check: str) -> bool:
    """Run the package check in the sandbox; for a local sandbox on the host's /usr, on the host."""
    if (await sandbox.exec(check, timeout=60)).ok:
        return True
    from miles_env.sandboxes.local import LocalSandbox

    if isinstance(sandbox, LocalSandbox) and sandbox.spec.rootfs is None:
        import anyio

        res = await anyio.run_process(["bash", "-c", check], check=False)
        return res.returncode == 0
    return False


@dataclass(slots=True)
class _Build:
    """What Docker carries from step to step of a stage (mutable: each step may change it)."""

    cwd: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    shell: list[str] = field(default_factory=lambda: ["/bin/sh", "-c"])


class _Skip(Exception):
    """The step's effect is already present (apt-get install of installed packages)."""


async def _root_only(sandbox: Sandbox, step: Step, text: str) -> None:
    """Refuse a package-manager or user step, unless every package it installs is already there."""
    hit = _ROOT_ONLY.search(text)
    if hit is None:
        return
    check = _apt_satisfied_cmd(text)
    if check is not None and await _installed(sandbox, check):
        raise _Skip
    raise TaskError(
        f"{step.describe()}: needs root or a package index ({hit.group(1)}), which this sandbox does not "
        "have; run the task on the docker provider with its base image available locally, or set "
        "[environment] docker_image in task.toml"
    )


async def _run(sandbox: Sandbox, step: Step, state: _Build, timeout: float) -> None:
    if step.args.startswith("--"):  # --mount, --network, --security: none can be honoured here
        split_flags(step, step.args.split()[:1], set())
    args, shell, cwd, env = step.args, state.shell, state.cwd, state.env
    argv: list[str]
    if args.startswith("[") and not step.heredocs:
        try:
            argv = [str(a) for a in json.loads(args)]
        except ValueError:
            argv = [*shell, args]  # not valid JSON: Docker runs it in the shell form
    elif len(step.heredocs) == 1 and re.fullmatch(r"<<-?\s*(['\"]?)[\w.-]+\1", args):
        h = step.heredocs[0]
        await _root_only(sandbox, step, h.content())
        scratch = f"/tmp/.miles-run-{uuid.uuid4().hex[:12]}"  # BuildKit's /dev/pipes: gone afterwards
        await sandbox.write_file(f"{scratch}/{h.name}", h.content())
        await sandbox.exec(f"chmod 755 {shlex.quote(f'{scratch}/{h.name}')}", timeout=30)
        argv = [*shell, f"{scratch}/{h.name}"]
    else:
        script = step.script() if step.heredocs else args
        await _root_only(sandbox, step, script)
        argv = [*shell, script]
    res = await sandbox.exec(argv, cwd=cwd, env=env, timeout=timeout)
    if argv[-1].startswith("/tmp/.miles-run-"):
        await sandbox.exec(["rm", "-rf", str(Path(argv[-1]).parent)], timeout=30)
    if not res.ok:
        tail = (res.stderr or res.stdout).strip()[-500:]
        raise TaskError(f"{step.describe()}: exit code {res.exit_code}: {tail}")


async def _workdir(sandbox: Sandbox, step: Step, state: _Build) -> None:
    state.cwd = abs_path(expand(step.args, state.env), state.cwd)
    mk = await sandbox.exec(f"mkdir -p {shlex.quote(state.cwd)}", timeout=30)
    if not mk.ok:
        raise TaskError(f"{step.describe()}: cannot create {state.cwd}: {mk.stderr.strip()[-300:]}")


def _shell(step: Step) -> list[str]:
    try:
        shell = json.loads(step.args)
    except ValueError:
        shell = None
    if not isinstance(shell, list) or not shell or not all(isinstance(w, str) for w in shell):
        raise TaskError(f'{step.describe()}: SHELL takes a JSON array, e.g. ["/bin/bash", "-c"]')
    return shell


async def _step(sandbox: Sandbox, step: Step, context: Path, state: _Build, timeout: float) -> None:
    env = state.env
    if step.op == "WORKDIR":
        await _workdir(sandbox, step, state)
    elif step.op == "ENV":
        env.update({k: expand(v, {**BASE_ENV, **env}) for k, v in env_pairs(step.args).items()})
    elif step.op == "ARG":
        name, default = arg_default(step.args)
        if default is not None:
            env.setdefault(name, expand(default, env))
    elif step.op == "SHELL":
        state.shell = _shell(step)
    elif step.op == "USER":
        if expand(step.args, env).strip() not in _ROOT_USERS:
            raise refuse(step, step.args.strip(), "a sandbox has one user")
    elif step.op in ("COPY", "ADD"):
        await copy_step(sandbox, step, context, state.cwd, env)
    elif step.op == "RUN":
        await _run(sandbox, step, state, timeout)
    else:
        raise refuse(step, "")


async def run_setup(sandbox: Sandbox, dockerfile: Path, *, timeout: float = 600.0) -> dict[str, Any]:
    """Replay the Dockerfile's final stage in `sandbox`; returns {"ran": [...], "env": {...}}."""
    steps = final_stage(parse_dockerfile(dockerfile.read_text()))
    state = _Build()
    ran: list[str] = []
    for step in steps:
        if step.op in _METADATA:
            continue
        try:
            await _step(sandbox, step, dockerfile.parent, state, timeout)
        except _Skip:
            pass
        ran.append(step.describe())
    return {"ran": ran, "env": state.env}
