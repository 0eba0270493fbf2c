"""A Harbor task's environment/Dockerfile, parsed as Docker's Dockerfile reference describes.

Concept: `parse_dockerfile` reads the Dockerfile into `Step`s: line continuations
joined, comments dropped, and here-documents (`RUN <<EOF`, `COPY <<EOF dst`, `<<-` to
strip leading tabs, a quoted delimiter to turn off expansion, several per line) read
into `Heredoc`s with their bodies. Two ways to make a sandbox match the Dockerfile:

- docker provider: the environment sets `SandboxSpec.build` to the environment
  directory and the provider builds it for real, offline, tagged by a hash of its content;
  a failed build fails the sandbox's creation with the log.
- any other sandbox (the local bwrap one): `replay.run_setup` replays the final stage
  as a setup phase, following Docker's semantics for every instruction and flag it
  accepts and refusing the rest by name (`Dockerfile:12: ADD --checksum is not supported
  by the local provider; use the docker provider`).

Invariant: parsing is pure (no file is read but the text given); `Step.line` is the
1-based line where the instruction starts, so every error can name it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from miles_env.errors import TaskError

__all__ = [
    "BASE_ENV",
    "Heredoc",
    "Step",
    "parse_dockerfile",
    "final_stage",
    "base_image",
    "static_env",
    "arg_default",
    "env_pairs",
    "expand",
    "split_flags",
    "refuse",
]

BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}  # Docker's default
_HEREDOC_OPS = {"RUN", "COPY", "ADD"}
_MARKER = re.compile(r"(?<![<\w])<<(-?)\s*(['\"]?)([A-Za-z_][\w.-]*)\2(?=\s|$)")


@dataclass(frozen=True, slots=True)
class Heredoc:
    name: str  # the delimiter word
    data: str  # the body as written, each line ending in "\n"
    chomp: bool  # `<<-`: leading tabs stripped from every body line
    expand: bool  # unquoted delimiter: build variables expanded (COPY/ADD bodies)

    def content(self) -> str:
        if not self.chomp:
            return self.data
        return "".join(line.lstrip("\t") for line in self.data.splitlines(keepends=True))


@dataclass(frozen=True, slots=True)
class Step:
    line: int  # 1-based line of the instruction in the Dockerfile
    op: str  # upper-case instruction, e.g. "RUN"
    args: str  # the argument text, continuations joined (heredoc bodies not included)
    heredocs: tuple[Heredoc, ...] = ()

    def describe(self) -> str:
        text = self.args if len(self.args) <= 120 else self.args[:117] + "..."
        return f"Dockerfile line {self.line}: {self.op} {text}"

    def script(self) -> str:
        """The shell text of a RUN with heredocs, bodies and terminators in place (`sh -c` parses it)."""
        return self.args + "".join(f"\n{h.data}{h.name}" for h in self.heredocs)


def _read_heredocs(args: str, lines: list[str], i: int) -> tuple[tuple[Heredoc, ...], int]:
    """The heredocs that `args` opens, read from lines[i:]; returns them and the next line index."""
    docs = []
    for m in _MARKER.finditer(args):
        chomp, quote, name = m.group(1) == "-", m.group(2), m.group(3)
        body: list[str] = []
        while i < len(lines) and (lines[i].lstrip("\t") if chomp else lines[i]) != name:
            body.append(lines[i] + "\n")
            i += 1
        if i == len(lines):
            raise TaskError(f"Dockerfile: here-document {name!r} is never terminated")
        i += 1
        docs.append(Heredoc(name, "".join(body), chomp, not quote))
    return tuple(docs), i


def parse_dockerfile(text: str) -> list[Step]:
    steps: list[Step] = []
    lines = text.splitlines()
    buf, start, i = "", 0, 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not buf:
            start = i
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        op, _, args = (buf + line).strip().partition(" ")
        buf, op, args = "", op.upper(), args.strip()
        heredocs: tuple[Heredoc, ...] = ()
        if op in _HEREDOC_OPS and not args.startswith("["):
            heredocs, i = _read_heredocs(args, lines, i)
        steps.append(Step(start, op, args, heredocs))
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


def env_pairs(args: str) -> dict[str, str]:
    """`ENV A=1 B="x y"` or the legacy `ENV A 1 2`."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words if "=" in w)


def arg_default(args: str) -> tuple[str, str | None]:
    """`ARG NAME=default` -> (NAME, default); `ARG NAME` -> (NAME, None): unset unless given."""
    name, eq, default = args.partition("=")
    return name.strip(), (default.strip().strip("\"'") if eq else None)


def static_env(steps: list[Step]) -> dict[str, str]:
    """The ENV values the final stage sets (ARG defaults and Docker's PATH expanded)."""
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    for step in final_stage(steps):
        if step.op == "ARG":
            name, default = arg_default(step.args)
            if default is not None:
                args.setdefault(name, default)
        elif step.op == "ENV":
            env.update({k: expand(v, {**BASE_ENV, **args, **env}) for k, v in env_pairs(step.args).items()})
    return env


_VAR = re.compile(r"\$\{(\w+)(?::([-+])([^}]*))?\}|\$(\w+)")


def expand(text: str, env: dict[str, str]) -> str:
    """Docker's build-time substitution: `$V`, `${V}`, `${V:-word}`, `${V:+word}` (unknown: left as is)."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(4)
        if m.group(2) == "-":
            return env.get(name) or m.group(3)
        if m.group(2) == "+":
            return m.group(3) if env.get(name) else ""
        return env.get(name, m.group(0))

    return _VAR.sub(sub, text)


def refuse(step: Step, what: str, why: str = "") -> TaskError:
    """The one-line refusal for an instruction or flag the replay does not implement."""
    return TaskError(
        f"Dockerfile:{step.line}: {f'{step.op} {what}' if what else step.op} is not supported by the local provider"
        f"{f' ({why})' if why else ''}; use the docker provider"
    )


def split_flags(step: Step, words: list[str], accepted: set[str]) -> tuple[dict[str, str], list[str]]:
    """Leading `--name[=value]` words -> ({name: value}, rest); any flag not in `accepted` refused."""
    flags: dict[str, str] = {}
    while words and words[0].startswith("--"):
        name, _, value = words.pop(0)[2:].partition("=")
        if name not in accepted:
            raise refuse(step, f"--{name}")
        flags[name] = value
    return flags, words
