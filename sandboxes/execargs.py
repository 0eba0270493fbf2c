"""What every provider does with exec()'s arguments before running anything.

One place for the contract's defaults: the timeout falls back to the spec's
`resources.timeout_s` and must be positive; stdin text is UTF-8; a shell string runs as
`/bin/sh -c` and an argv list as is; a relative cwd is under the default cwd.

Environment, lowest first: our defaults (Docker's default PATH, LANG=C.UTF-8,
PYTHONDONTWRITEBYTECODE=1), the image's ENV (its PATH too: golang and JDK images put their
toolchains there), then the spec's env, then the call's. HOME: a sandbox with an image gets its
user's passwd home (`home`, which the local provider reads from the image's /etc/passwd; the
docker engine sets it itself when none is passed), as a container does; one without an image
(the local provider's view of the host) keeps HOME = its workdir. The default cwd is the image's
WORKDIR, else the spec's workdir.

No bytecode cache by default: a .pyc is trusted on the source's mtime (whole seconds) and size,
so an agent's same-size fix made in the second after a test imported the module (`a - b` ->
`a + b`) would keep running the old code, in the agent's later runs and in the verifier: a
correct episode graded 0. A spec's (or an image's) env may turn it back on.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass

from miles_env.errors import SandboxError
from miles_env.sandbox import Command
from miles_env.types import SandboxSpec

from .images.oci import ImageConfig

__all__ = ["DEFAULT_PATH", "ExecArgs", "command_argv", "exec_args", "exec_env", "exec_cwd", "default_cwd"]

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


def exec_env(
    spec: SandboxSpec,
    workdir: str,
    env: Mapping[str, str] | None,
    *,
    image: ImageConfig | None = None,
    home: str | None = None,
) -> dict[str, str]:
    """`image` None: a sandbox without an image (HOME = workdir); else its ENV, and HOME = `home` if given."""
    base = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    if image is None:
        base["HOME"] = workdir
    elif home is not None:
        base["HOME"] = home
    return {**base, **(image.env if image is not None else {}), **spec.env, **(env or {})}


def default_cwd(workdir: str, image: ImageConfig | None = None) -> str:
    return image.workdir if image is not None and image.workdir else workdir


def exec_cwd(workdir: str, cwd: str | None) -> str:
    """`cwd` (relative: under `workdir`, the default cwd), or `workdir` itself."""
    return workdir if cwd is None else posixpath.join(workdir, cwd)


def exec_args(
    spec: SandboxSpec,
    workdir: str,
    *,
    timeout: float | None,
    cwd: str | None,
    env: Mapping[str, str] | None,
    stdin: bytes | str | None,
    image: ImageConfig | None = None,
    home: str | None = None,
) -> ExecArgs:
    limit = spec.resources.timeout_s if timeout is None else timeout
    if limit <= 0:
        raise SandboxError(f"exec: timeout={timeout!r} must be > 0")
    data = stdin.encode() if isinstance(stdin, str) else stdin
    environment = exec_env(spec, workdir, env, image=image, home=home)
    return ExecArgs(limit, environment, exec_cwd(default_cwd(workdir, image), cwd), data)
