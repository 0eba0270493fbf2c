"""A Harbor task's environment/Dockerfile, honoured without a container build where possible.

Concept: `parse_dockerfile` reads the Dockerfile into `Step`s (line continuations
joined, comments dropped). Two ways to make a sandbox match it:

- docker provider: the environment sets `SandboxSpec.build` to the environment
  directory and the provider builds it for real, offline (no pull, no network),
  tagged by a hash of its content, so an unchanged task builds once
  (the docker provider); a failed build fails the sandbox's creation with the log.
- any other sandbox (the local bwrap one): `run_setup` replays the steps in the
  sandbox as a setup phase: `WORKDIR` (mkdir, becomes the cwd), `ENV`/`ARG`
  (environment of later steps), `COPY`/`ADD` (files from the build context, binary
  too), `RUN` (shell form `/bin/sh -c`, exec form argv). A step that cannot run there
  (a package manager or user change needing root, `COPY --from`, a failing command, a
  path outside the writable workspace) raises `TaskError` naming the Dockerfile line.
  `apt-get install` steps whose packages are all already installed are skipped.

Invariant: nothing on the host is written; steps run in Dockerfile order with the
cwd and environment Docker would give them.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_env.errors import TaskError
from miles_env.sandbox import Sandbox

__all__ = [
    "Step",
    "parse_dockerfile",
    "base_image",
    "static_env",
    "run_setup",
]

BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}  # Docker's default
_IGNORED = {"FROM", "CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "HEALTHCHECK", "VOLUME"}
_IGNORED |= {"STOPSIGNAL", "SHELL", "ONBUILD", "USER"}
# Commands that need root or a package index: not runnable in an unprivileged, offline sandbox.
_ROOT_ONLY = re.compile(
    r"(?:^|[;&|(]\s*|\bsudo\s+)(apt|apt-get|aptitude|dpkg|yum|dnf|microdnf|apk|zypper|pacman|"
    r"useradd|adduser|groupadd|addgroup|usermod|chown|chsh|locale-gen|update-alternatives|systemctl)\b"
)
_APT_OK = re.compile(r"^(?:DEBIAN_FRONTEND=\S+\s+)?apt(?:-get)?\s+(update|clean|install|-y|-qq|-q|--\S+|\s)+")


@dataclass(frozen=True, slots=True)
class Step:
    line: int  # 1-based line of the instruction in the Dockerfile
    op: str  # upper-case instruction, e.g. "RUN"
    args: str  # the argument text, continuations joined

    def describe(self) -> str:
        text = self.args if len(self.args) <= 120 else self.args[:117] + "..."
        return f"Dockerfile line {self.line}: {self.op} {text}"


def parse_dockerfile(text: str) -> list[Step]:
    steps: list[Step] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        op, _, args = buf.strip().partition(" ")
        steps.append(Step(start, op.upper(), args.strip()))
        buf = ""
    if buf.strip():
        op, _, args = buf.strip().partition(" ")
        steps.append(Step(start, op.upper(), args.strip()))
    return steps


def final_stage(steps: list[Step]) -> list[Step]:
    """The steps of the last stage (from its FROM on)."""
    starts = [i for i, s in enumerate(steps) if s.op == "FROM"]
    return steps[starts[-1] :] if starts else steps


def base_image(steps: list[Step]) -> str | None:
    stage = final_stage(steps)
    if not stage or stage[0].op != "FROM":
        return None
    words = [w for w in stage[0].args.split() if not w.startswith("--")]
    return words[0] if words else None


def _env_pairs(args: str) -> dict[str, str]:
    """`ENV A=1 B="x y"` or the legacy `ENV A 1 2`."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words if "=" in w)


def static_env(steps: list[Step]) -> dict[str, str]:
    """The ENV values the final stage sets (ARG defaults and Docker's PATH expanded)."""
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    for step in final_stage(steps):
        if step.op == "ARG":
            name, _, default = step.args.partition("=")
            args.setdefault(name.strip(), default.strip().strip("\"'"))
        elif step.op == "ENV":
            env.update({k: _expand(v, {**BASE_ENV, **args, **env}) for k, v in _env_pairs(step.args).items()})
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)


def _abs(path: str, cwd: str) -> str:
    return path if path.startswith("/") else f"{cwd.rstrip('/')}/{path}"


def _context_files(context: Path, src: str, step: Step) -> list[tuple[Path, str]]:
    """(host file, path relative to the destination) for one COPY source."""
    root = context.resolve()
    target = (root / src).resolve()
    if target != root and root not in target.parents:
        raise TaskError(f"{step.describe()}: source {src!r} is outside the build context")
    if target.is_file():
        return [(target, target.name)]
    if target.is_dir():
        return [(p, str(p.relative_to(target))) for p in sorted(target.rglob("*")) if p.is_file()]
    matches = sorted(root.glob(src))
    if not matches:
        raise TaskError(f"{step.describe()}: source {src!r} not found in {root}")
    return [(p, p.name) for p in matches if p.is_file()]


async def _copy(sandbox: Sandbox, step: Step, context: Path, cwd: str, env: dict[str, str]) -> None:
    words = shlex.split(_expand(step.args, env))
    if any(w.startswith("--from") for w in words):
        raise TaskError(f"{step.describe()}: multi-stage COPY --from needs a docker build")
    words = [w for w in words if not w.startswith("--")]
    if len(words) < 2:
        raise TaskError(f"{step.describe()}: needs a source and a destination")
    *srcs, dst = words
    dst_abs = _abs(dst, cwd)
    into_dir = dst.endswith("/") or len(srcs) > 1
    for src in srcs:
        if re.match(r"^[a-z]+://", src):
            raise TaskError(f"{step.describe()}: a URL source needs the network")
        for host, rel in _context_files(context, src, step):
            is_dir_src = (context / src).is_dir()
            target = f"{dst_abs.rstrip('/')}/{rel}" if (into_dir or is_dir_src) else dst_abs
            mk = await sandbox.exec(f"mkdir -p {shlex.quote(str(Path(target).parent))}", timeout=30)
            try:
                if not mk.ok:
                    raise TaskError(mk.stderr.strip()[-300:])
                await sandbox.write_file(target, host.read_bytes())
            except Exception as e:  # the sandbox's own error says why (read-only, outside mounts)
                raise TaskError(f"{step.describe()}: cannot write {target}: {e}") from e


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


async def _run(sandbox: Sandbox, step: Step, cwd: str, env: dict[str, str], timeout: float) -> None:
    args = step.args
    argv: list[str] | None = None
    if args.startswith("["):
        try:
            argv = [str(a) for a in json.loads(args)]
        except ValueError:
            argv = None
    if argv is None and _ROOT_ONLY.search(args):
        check = _apt_satisfied_cmd(args)
        if check is not None and await _installed(sandbox, check):
            return  # every package it installs is already there
        word = _ROOT_ONLY.search(args).group(1)  # type: ignore[union-attr]
        raise TaskError(
            f"{step.describe()}: needs root or a package index ({word}), which this sandbox does not "
            "have; run the task on the docker provider with its base image available locally, or set "
            "[environment] docker_image in task.toml"
        )
    res = await sandbox.exec(argv if argv is not None else args, cwd=cwd, env=env, timeout=timeout)
    if not res.ok:
        tail = (res.stderr or res.stdout).strip()[-500:]
        raise TaskError(f"{step.describe()}: exit code {res.exit_code}: {tail}")


async def run_setup(sandbox: Sandbox, dockerfile: Path, *, timeout: float = 600.0) -> dict[str, Any]:
    """Replay the Dockerfile's final stage in `sandbox`; returns {"ran": [...], "env": {...}}."""
    steps = final_stage(parse_dockerfile(dockerfile.read_text()))
    context, cwd = dockerfile.parent, "/"
    env: dict[str, str] = {}
    ran: list[str] = []
    for step in steps:
        if step.op in _IGNORED:
            continue
        if step.op == "WORKDIR":
            cwd = _abs(_expand(step.args, env), cwd)
            mk = await sandbox.exec(f"mkdir -p {shlex.quote(cwd)}", timeout=30)
            if not mk.ok:
                raise TaskError(f"{step.describe()}: cannot create {cwd}: {mk.stderr.strip()[-300:]}")
        elif step.op == "ENV":
            env.update({k: _expand(v, {**BASE_ENV, **env}) for k, v in _env_pairs(step.args).items()})
        elif step.op == "ARG":
            name, _, default = step.args.partition("=")
            env.setdefault(name.strip(), default.strip().strip("\"'"))
        elif step.op in ("COPY", "ADD"):
            await _copy(sandbox, step, context, cwd, env)
        elif step.op == "RUN":
            await _run(sandbox, step, cwd, env, timeout)
        else:
            raise TaskError(f"{step.describe()}: instruction {step.op} is not supported")
        ran.append(step.describe())
    return {"ran": ran, "env": env}
