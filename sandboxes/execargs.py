"""What every provider does with exec()'s arguments before running anything.

One place for the contract's defaults: the timeout falls back to the spec's
`resources.timeout_s` and must be positive; the environment is PATH/HOME/LANG and
PYTHONDONTWRITEBYTECODE=1, then the spec's env, then the call's; a relative cwd is under the workdir;
stdin text is UTF-8; a shell string runs as `/bin/sh -c` and an argv list as is.

No bytecode cache by default: a .pyc is trusted on the source's mtime (whole seconds) and size,
so an agent's same-size fix made in the second after a test imported the module (`a - b` ->
`a + b`) would keep running the old code, in the agent's later runs and in the verifier: a
correct episode graded 0. A spec's env may turn it back on.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass

from miles_env.errors import SandboxError
from miles_env.sandbox import Command
from miles_env.types import SandboxSpec

__all__ = ["DEFAULT_PATH", "ExecArgs", "command_argv", "exec_args", "exec_env", "exec_cwd"]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True, slots=True)
class ExecArgs:
    timeout: float
    env: dict[str, str]
    cwd: str
    stdin: bytes | None


def command_argv(cmd: Command) -> list[str]:
    """The argv that runs `cmd`: a shell string under `/bin/sh -c`, an argv list as is (never empty)."""
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    argv = [str(a) for a in cmd]
    if not argv:
        raise SandboxError("exec: cmd is an empty argv list")
    return argv


def exec_env(spec: SandboxSpec, workdir: str, env: Mapping[str, str] | None) -> dict[str, str]:
    base = {"PATH": DEFAULT_PATH, "HOME": workdir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    return {**base, **spec.env, **(env or {})}


def exec_cwd(workdir: str, cwd: str | None) -> str:
    return workdir if cwd is None else posixpath.join(workdir, cwd)


def exec_args(
    spec: SandboxSpec,
    workdir: str,
    *,
    timeout: float | None,
    cwd: str | None,
    env: Mapping[str, str] | None,
    stdin: bytes | str | None,
) -> ExecArgs:
    limit = spec.resources.timeout_s if timeout is None else timeout
    if limit <= 0:
        raise SandboxError(f"exec: timeout={timeout!r} must be > 0")
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return ExecArgs(limit, exec_env(spec, workdir, env), exec_cwd(workdir, cwd), data)
