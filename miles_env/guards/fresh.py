"""`fresh_copy`: a new sandbox holding only the agent's final workspace, for `verify_in = "fresh"`.

Concept: the agent may leave things outside its workspace that a verifier run in the same sandbox
would pick up: a fake test runner in /tmp on a PATH the task uses, a planted module, a background
state file. For a fresh verify the workspace (the workdir tree, `.git` included, symlinks as
links) is packed with tar in the agent's sandbox, read out through the provider, and unpacked
into a new sandbox made from the same spec, with only the spec's files *outside* the workdir
written again (the starting state of those places). `Environment.setup` is not run again: it
would reset the workspace the agent left.

Invariant: nothing but the workdir tree crosses; the new sandbox is closed by its caller
(`async with`). The archive is read whole (at most `max_read_bytes`, 64 MiB by default, on local).
"""

from __future__ import annotations

import posixpath

from miles_env.errors import SandboxError
from miles_env.sandbox import Sandbox, SandboxProvider
from miles_env.types import SandboxSpec

__all__ = ["fresh_copy"]

_ARCHIVE = "/tmp/.miles-env-workspace.tgz"
_PATH = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


def _outside(spec: SandboxSpec) -> dict[str, str]:
    """The spec's files that do not live under the workdir (they are not part of what is copied)."""
    root = spec.workdir.rstrip("/") + "/"
    return {
        p: text
        for p, text in spec.files.items()
        if p.startswith("/") and not posixpath.normpath(p).startswith(root)
    }


async def fresh_copy(provider: SandboxProvider, spec: SandboxSpec, agent_sb: Sandbox) -> Sandbox:
    """Pack `agent_sb`'s workdir, create a sandbox of `spec` (without the workdir's files) and
    unpack it there; return the new, open sandbox."""
    pack = await agent_sb.exec(
        ["sh", "-c", f'rm -f {_ARCHIVE} && tar -czf {_ARCHIVE} -C "$1" .', "sh", agent_sb.workdir],
        timeout=300,
        env=_PATH,
    )
    if not pack.ok:
        raise SandboxError(f"fresh verify: packing {agent_sb.workdir} failed: {pack.stderr.strip()[-300:]}")
    data = await agent_sb.read_file(_ARCHIVE)
    sb = await provider.create(spec.model_copy(update={"files": _outside(spec)}))
    try:
        await sb.write_file(_ARCHIVE, data)
        unpack = await sb.exec(
            ["sh", "-c", f'tar -xzf {_ARCHIVE} -C "$1" && rm -f {_ARCHIVE}', "sh", sb.workdir],
            timeout=300,
            env=_PATH,
        )
        if not unpack.ok:
            raise SandboxError(
                f"fresh verify: unpacking into {sb.workdir} failed: {unpack.stderr.strip()[-300:]}"
            )
    except BaseException:
        await sb.close()
        raise
    return sb
