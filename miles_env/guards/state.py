"""The starting state a guard keeps, and how the end state is compared with it.

Concept: right after `Environment.setup`, `snapshot` reads every protected path through the
provider (`Sandbox.read_file`: local reads the bytes on the host and docker through the engine's
archive API, so no tool inside the sandbox is trusted; the cloud providers read with an exec of
`base64` inside, which an agent that can write to /usr could fool) and keeps its bytes and
sha256, plus, when the workdir is a git repository (`.git/HEAD` read through the provider), its
object ids (one exec; a repository deeper in the tree is not listed). After the harness stopped,
`changed_paths` reads them again: a path whose bytes differ, that vanished, or that appeared
under a protected directory is a `test_edit`. `restore` writes the starting bytes back (and
removes what appeared) before verify, so the verifier runs the task's own tests whatever the
agent did to them.

A protected path ending in `/` is a directory: its files are listed (an exec of `find`) at both
ends. What this cannot see: an edit undone before the agent stopped (harmless: verify sees the
starting bytes), or a change outside the protected paths (declare them: `Environment.protected_paths`).
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field

from miles_env.errors import SandboxError
from miles_env.sandbox import Sandbox

__all__ = ["StartState", "snapshot", "changed_paths", "restore", "MAX_GIT_OBJECTS"]

MAX_GIT_OBJECTS = 15_000  # beyond this the object list is not kept (object ids are not checked)
_PATH = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
_GIT_OBJECTS = (
    f"git cat-file --batch-all-objects --batch-check='%(objectname)' | head -n {MAX_GIT_OBJECTS + 1}"
)


@dataclass(frozen=True, slots=True)
class StartState:
    files: dict[str, bytes | None]  # protected file -> its starting bytes (None: absent)
    dirs: tuple[str, ...]  # protected directories (their files are in `files`)
    git_objects: tuple[str, ...] | None  # object ids at the start; None: no repo or too many
    digests: dict[str, str | None] = field(default_factory=dict)


def _digest(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


async def _read(sb: Sandbox, path: str) -> bytes | None:
    try:
        return await sb.read_file(path)
    except SandboxError:  # absent, a directory, a symlink, too large: not the starting file
        return None


async def _list_dir(sb: Sandbox, d: str) -> list[str]:
    res = await sb.exec(["find", d.rstrip("/"), "-type", "f"], timeout=60, env=_PATH)
    return sorted(line for line in res.stdout.splitlines() if line) if res.exit_code == 0 else []


async def _expand(sb: Sandbox, paths: Sequence[str]) -> tuple[list[str], list[str]]:
    files, dirs = [], []
    for p in paths:
        if p.endswith("/"):
            dirs.append(p)
            files.extend(await _list_dir(sb, p))
        else:
            files.append(p)
    return sorted(set(files)), dirs


async def snapshot(sb: Sandbox, protected: Sequence[str], *, git: bool = True) -> StartState:
    files, dirs = await _expand(sb, protected)
    content = {p: await _read(sb, p) for p in files}
    objects: tuple[str, ...] | None = None
    if git and await _read(sb, ".git/HEAD") is not None:  # a repository at the workdir (a host read)
        res = await sb.exec(["sh", "-c", _GIT_OBJECTS], timeout=60, env=_PATH)
        ids = tuple(line.strip() for line in res.stdout.splitlines() if line.strip())
        objects = ids if ids and len(ids) <= MAX_GIT_OBJECTS else None
    digests = {p: _digest(b) for p, b in content.items()}
    return StartState(content, tuple(dirs), objects, digests)


async def changed_paths(sb: Sandbox, start: StartState) -> list[dict[str, str | None]]:
    """Protected paths whose content differs from the start: `{path, start, end}` sha256 (None: absent)."""
    now, _ = await _expand(sb, [*start.files, *start.dirs])
    rows = []
    for p in now:
        end = _digest(await _read(sb, p))
        begin = start.digests.get(p)
        if end != begin:
            rows.append({"path": p, "start": begin, "end": end})
    return rows


async def restore(sb: Sandbox, start: StartState, changed: Sequence[dict[str, str | None]]) -> None:
    """Put every changed protected path back as it was (written, or removed if it was absent)."""
    for row in changed:
        path = str(row["path"])
        original = start.files.get(path)
        await sb.exec(["rm", "-rf", "--", path], timeout=60, env=_PATH)
        if original is not None:
            parent = posixpath.dirname(path)
            if parent:
                await sb.exec(["mkdir", "-p", "--", parent], timeout=60, env=_PATH)
            await sb.write_file(path, original)
