"""COPY and ADD replayed in a sandbox, with the semantics of Docker's Dockerfile reference.

Concept: `copy_step` resolves each source against the build context (a file, a
directory whose *contents* are copied, a wildcard, or a here-document), writes the
bytes with `Sandbox.write_file` and then applies the modes in one exec: the source
file's own permission bits (Docker keeps them), or `--chmod` (octal or symbolic) on
every file and directory copied; `--chown` runs `chown` in the sandbox and is refused
with chown's reason where the sandbox cannot change owners. ADD of a local tar
archive (plain, gzip, bzip2 or xz, recognised by content, not by name) is unpacked
into the destination directory (modes kept, merged with what is there); any other
local file is copied as COPY would. `--link` changes only layer caching and is accepted.
Files the context's `.dockerignore` excludes (Docker's patterns: `*`, `?`, `**`, `!`
exceptions, last match wins, a matched folder excludes its contents) are not in the
context, so no COPY or ADD sees them.

Invariant: a source outside the build context, a URL (the sandbox has no network),
`--from` (another stage) or a flag not named above fails the step, naming its line.
"""

from __future__ import annotations

import json
import re
import shlex
import tarfile
import uuid
from collections.abc import Callable
from pathlib import Path

from miles_env.adapters.harbor.dockerfile import _MARKER, Step, expand, refuse, split_flags
from miles_env.errors import TaskError
from miles_env.sandbox import Sandbox

__all__ = ["copy_step", "is_tar_archive", "abs_path", "ignored"]

_CHMOD = re.compile(r"^(?:[0-7]{3,4}|[ugoa]*[-+=][rwxXst]*(?:,[ugoa]*[-+=][rwxXst]*)*)$")
_URL = re.compile(r"^(?:[a-z][a-z0-9+.-]*://|git@)")
_CHUNK = 200  # paths per chmod/mkdir exec, well under one argument's 128 KiB


def abs_path(path: str, cwd: str) -> str:
    return path if path.startswith("/") else f"{cwd.rstrip('/')}/{path}"


def is_tar_archive(path: Path) -> bool:
    """A tar stream, plain or gzip/bzip2/xz compressed, judged by content as Docker does."""
    try:
        with tarfile.open(path, "r:*") as tf:
            return tf.next() is not None
    except (tarfile.TarError, OSError, EOFError):
        return False


def _pattern(pat: str) -> re.Pattern[str]:
    pat = pat.strip().strip("/")
    out = "".join(
        ".*" if tok == "**" else "[^/]*" if tok == "*" else "[^/]" if tok == "?" else re.escape(tok)
        for tok in re.findall(r"\*\*|\*|\?|[^*?]+", pat)
    )
    return re.compile(out.replace(".*/", "(?:.*/)?") + "$")


def ignored(context: Path) -> Callable[[str], bool]:
    """`rel -> excluded?` from the context's .dockerignore (nothing excluded without one)."""
    f = context / ".dockerignore"
    lines = f.read_text().splitlines() if f.is_file() else []
    rules = [
        (ln.startswith("!"), _pattern(ln.lstrip("!")))
        for ln in lines
        if ln.strip() and not ln.startswith("#")
    ]

    def check(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        excluded = False
        for negate, rx in rules:
            if any(rx.match(p) for p in prefixes):
                excluded = not negate
        return excluded

    return check


def _sources(context: Path, src: str, step: Step) -> list[tuple[Path, str, bool]]:
    """(host path, path relative to the destination, from a directory) for one source.

    A directory contributes its contents (not itself), as in Docker."""
    root = context.resolve()
    if any(c in src for c in "*?["):
        matches = sorted(root.glob(src.lstrip("/")))
    else:
        matches = [root / src.lstrip("/")] if (root / src.lstrip("/")).exists() else []
    skip = ignored(root)
    matches = [m for m in matches if m == root or not skip(m.relative_to(root).as_posix())]
    if not matches:
        raise TaskError(f"{step.describe()}: source {src!r} not found in {root}")
    out: list[tuple[Path, str, bool]] = []
    for m in matches:
        m = m.resolve()
        if m != root and root not in m.parents:
            raise TaskError(f"{step.describe()}: source {src!r} is outside the build context")
        if m.is_dir():
            inner = [p for p in sorted(m.rglob("*")) if not skip(p.relative_to(root).as_posix())]
            out += [(p, p.relative_to(m).as_posix(), True) for p in inner]
        else:
            out.append((m, m.name, False))
    return out


async def _sh(sandbox: Sandbox, step: Step, what: str, cmds: list[str]) -> None:
    for i in range(0, len(cmds), _CHUNK):
        res = await sandbox.exec(" && ".join(cmds[i : i + _CHUNK]), timeout=120)
        if not res.ok:
            raise TaskError(f"{step.describe()}: {what}: {(res.stderr or res.stdout).strip()[-300:]}")


async def _unpack(sandbox: Sandbox, step: Step, archive: Path, dst: str) -> None:
    tmp = f"/tmp/.miles-add-{uuid.uuid4().hex[:12]}"
    await sandbox.write_file(tmp, archive.read_bytes())
    q = shlex.quote(dst)
    await _sh(sandbox, step, f"cannot unpack {archive.name}", [
        f"mkdir -p {q}", f"tar -xpf {tmp} -C {q} --no-same-owner", f"rm -f {tmp}",
    ])  # fmt: skip


def _words(step: Step) -> tuple[dict[str, str], list[str]]:
    """(flags, sources + destination): leading `--flag[=v]` words, then the shell or JSON form."""
    m = re.match(r"((?:--\S+\s+)*)(.*)$", step.args, re.S)
    assert m is not None  # the pattern matches any text
    flag_words, rest = m.group(1).split(), m.group(2).strip()
    if any(w == "--from" or w.startswith("--from=") for w in flag_words):
        raise refuse(step, "--from", "a multi-stage COPY --from needs a docker build")
    flags, _ = split_flags(step, flag_words, {"chmod", "chown", "link"})
    if rest.startswith("["):  # the JSON form: COPY ["src", "dst"]
        try:
            return flags, [str(w) for w in json.loads(rest)]
        except ValueError as e:
            raise TaskError(f"{step.describe()}: bad JSON form: {e}") from e
    return flags, shlex.split(rest)


async def copy_step(sandbox: Sandbox, step: Step, context: Path, cwd: str, env: dict[str, str]) -> None:
    """One COPY or ADD instruction, applied in the sandbox."""
    flags, words = _words(step)
    words = [expand(w, env) for w in words]
    if len(words) < 2:
        raise TaskError(f"{step.describe()}: needs a source and a destination")
    if flags.get("chmod") is not None and not _CHMOD.match(flags["chmod"]):
        raise TaskError(f"{step.describe()}: --chmod={flags['chmod']!r} is not a file mode")
    *srcs, dst = words
    dst_abs = abs_path(dst, cwd)
    into_dir = dst.endswith("/") or len(srcs) > 1
    if not into_dir:  # an existing directory receives the file, as in Docker
        into_dir = (await sandbox.exec(f"test -d {shlex.quote(dst_abs)}", timeout=30)).ok
    heredocs = iter(step.heredocs)
    files: list[tuple[str, bytes, int]] = []  # (target, bytes, source mode)
    dirs: list[str] = []
    for src in srcs:
        if _MARKER.fullmatch(src) or (src.startswith("<<") and step.heredocs):
            h = next(heredocs)
            text = expand(h.content(), env) if h.expand else h.content()
            files.append((f"{dst_abs.rstrip('/')}/{h.name}" if into_dir else dst_abs, text.encode(), 0o644))
            continue
        if _URL.match(src):
            if step.op == "COPY":
                raise TaskError(f"{step.describe()}: COPY cannot take a URL source")
            raise refuse(step, "of a URL", "the sandbox has no network")
        entries = _sources(context, src, step)
        if not into_dir and sum(not from_dir for _, _, from_dir in entries) > 1:
            raise TaskError(
                f"{step.describe()}: {src!r} matches several files; the destination must end in /"
            )
        for host, rel, from_dir in entries:
            target = f"{dst_abs.rstrip('/')}/{rel}" if (into_dir or from_dir) else dst_abs
            if step.op == "ADD" and host.is_file() and is_tar_archive(host):
                if flags.get("chmod") is not None or flags.get("chown") is not None:
                    raise refuse(step, "--chmod/--chown with a tar archive")
                await _unpack(sandbox, step, host, dst_abs)
            elif host.is_dir():
                dirs.append(target)
            else:
                files.append((target, host.read_bytes(), host.stat().st_mode & 0o7777))
    await _apply(sandbox, step, flags, files, dirs)


async def _apply(
    sandbox: Sandbox, step: Step, flags: dict[str, str], files: list[tuple[str, bytes, int]], dirs: list[str]
) -> None:
    parents = sorted({str(Path(t).parent) for t, _, _ in files} | set(dirs))
    await _sh(sandbox, step, "cannot create folders", [f"mkdir -p {shlex.quote(p)}" for p in parents])
    for target, data, _ in files:
        try:
            await sandbox.write_file(target, data)
        except Exception as e:  # the sandbox's own error says why (read-only, outside mounts)
            raise TaskError(f"{step.describe()}: cannot write {target}: {e}") from e
    chmod = flags.get("chmod")
    if chmod:
        modes = [f"chmod {shlex.quote(chmod)} {shlex.quote(t)}" for t in [*dirs, *(t for t, _, _ in files)]]
    else:
        modes = [f"chmod {m:o} {shlex.quote(t)}" for t, _, m in files]
    await _sh(sandbox, step, "cannot set modes", modes)
    if flags.get("chown"):
        targets = [*dirs, *(t for t, _, _ in files)]
        cmds = [f"chown {shlex.quote(flags['chown'])} {shlex.quote(t)}" for t in targets]
        try:
            await _sh(sandbox, step, "chown", cmds)
        except TaskError as e:
            raise refuse(step, f"--chown={flags['chown']}", str(e).rsplit(": ", 1)[-1]) from e
