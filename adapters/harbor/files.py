"""A Harbor task's tests/ and solution/ folders, carried into a sandbox byte for byte.

Concept: `read_tree(root)` reads every regular file under a folder as a `TaskFile`
(relative path, bytes, permission bits); `upload(sandbox, base, files)` writes them
with `Sandbox.write_file` (binary-safe, any size) and restores their modes in one
exec, as Harbor's `upload_dir` does. A reference solution must also work as a
plain shell script (`Task.solution`), so `embed_script` writes the same files from
base64 inside the script when they fit in one exec argument; larger ones are staged
by the oracle runner (`HarborTasksEnvironment.stage_solution`).

Invariant: the only change to a file's bytes is `rebase_paths` on UTF-8 text files
of at most 1 MiB (Harbor's absolute `/logs`, `/tests`, `/solution` moved under
`/tmp/harbor`, without which no script could write its reward on a read-only root);
binary or larger files arrive unchanged, and every file keeps its permission bits.
"""

from __future__ import annotations

import base64
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from miles_env.errors import TaskError
from miles_env.sandbox import Sandbox

__all__ = [
    "TaskFile",
    "HARBOR_ROOT",
    "EMBED_LIMIT",
    "rebase_paths",
    "read_tree",
    "upload",
    "embed_script",
    "solution_script",
]

HARBOR_ROOT = "/tmp/harbor"
EMBED_LIMIT = 96 * 1024  # base64 bytes a script may carry: one exec argument is capped at 128 KiB
_REBASE_LIMIT = 1 << 20
_ABS = re.compile(r"(?<![\w.~/-])/(logs|tests|solution)(?=/|\b)")


@dataclass(frozen=True, slots=True)
class TaskFile:
    rel: str  # path relative to the folder, '/'-separated
    data: bytes
    mode: int  # permission bits, e.g. 0o755


def rebase_paths(text: str, root: str = HARBOR_ROOT) -> str:
    """`/logs/x` -> `/tmp/harbor/logs/x` (and /tests, /solution), leaving other paths alone."""
    return _ABS.sub(lambda m: f"{root}/{m.group(1)}", text)


def _rebased(data: bytes) -> bytes:
    if len(data) > _REBASE_LIMIT:
        return data
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return data
    return rebase_paths(text).encode()


def read_tree(root: Path) -> list[TaskFile]:
    """Every regular file under `root` (none when it is missing), in path order."""
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = p.relative_to(root).as_posix()
            out.append(TaskFile(rel, _rebased(p.read_bytes()), p.stat().st_mode & 0o7777))
    return out


async def upload(sandbox: Sandbox, base: str, files: list[TaskFile], user: str | None = None) -> None:
    """Write `files` under `base` in the sandbox, then give each its mode (one exec); the folders
    made and the modes given by `user` (None: the sandbox's USER)."""
    for f in files:
        target = f"{base}/{f.rel}"
        mk = await sandbox.exec(f"mkdir -p {shlex.quote(str(Path(target).parent))}", timeout=30, user=user)
        if not mk.ok:
            raise TaskError(f"{target}: cannot create its folder: {mk.stderr.strip()[-300:]}")
        await sandbox.write_file(target, f.data)
    if files:
        modes = " && ".join(f"chmod {f.mode:o} {shlex.quote(f'{base}/{f.rel}')}" for f in files)
        res = await sandbox.exec(modes, timeout=60, user=user)
        if not res.ok:  # a non-root USER cannot chmod what write_file made: own a copy, then chmod
            own = " && ".join(
                f"cp -f {q} {q}.miles && mv -f {q}.miles {q} && chmod {f.mode:o} {q}"
                for f in files
                for q in [shlex.quote(f"{base}/{f.rel}")]
            )
            res = await sandbox.exec(own, timeout=120, user=user)
        if not res.ok:
            raise TaskError(f"{base}: cannot set file modes: {res.stderr.strip()[-300:]}")


def embed_script(base: str, files: list[TaskFile]) -> str | None:
    """Shell lines that recreate `files` under `base` (bytes and modes); None when too large."""
    if sum(len(f.data) for f in files) * 4 // 3 > EMBED_LIMIT:
        return None
    lines = []
    for f in files:
        target = shlex.quote(f"{base}/{f.rel}")
        lines.append(f"mkdir -p {shlex.quote(str(Path(base, f.rel).parent))}")
        lines.append(f"printf '%s' {base64.b64encode(f.data).decode()} | base64 -d > {target}")
        lines.append(f"chmod {f.mode:o} {target}")
    return "\n".join(lines)


def solution_script(sol_root: Path, workdir: str, env: dict[str, str]) -> str | None:
    """`bash solve.sh` in the workdir with [solution.env], its files embedded (or staged by the
    oracle when too large)."""
    files = read_tree(sol_root)
    if not any(f.rel == "solve.sh" for f in files):
        return None
    sol_dir = f"{HARBOR_ROOT}/solution"
    embedded = embed_script(sol_dir, files)
    if embedded is None:
        size = sum(len(f.data) for f in files)
        embedded = (
            f"test -f {sol_dir}/solve.sh || {{ echo 'harbor: the solution files ({size} bytes) are too "
            "large for a script; the oracle runner uploads them (stage_solution)' >&2; exit 1; }"
        )
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    return f"{embedded}\n{exports}cd {shlex.quote(workdir)} && DEBIAN_FRONTEND=noninteractive bash {sol_dir}/solve.sh"
