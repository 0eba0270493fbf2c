"""A Dockerfile as the builders here take it: the images it names, and BuildKit syntax lowered.

Concept: the builders on these machines (Debian's buildah 1.28 and dockerd 20.10's classic
builder) read the Dockerfile themselves; this module only (1) finds the images it pulls (each
`FROM` that is not an earlier stage or `scratch`, each `--from=` of COPY/ADD/RUN --mount that is
not a stage), with the global `ARG` defaults expanded as Docker does, (2) points them at the
images the resolver chose, and (3) lowers BuildKit's here-documents, which neither builder
parses, into what BuildKit itself runs (dockerfile2llb's rules):
- `RUN <<EOF` alone: the body runs as `SHELL + [body]`; with a `#!` first line it is written
  to a file (mode 755) and executed, so the `#!` picks the interpreter.
- `RUN cmd <<EOF ...` (any other form): the command line and bodies go to the shell as one script.
- `COPY/ADD <<NAME dest`: the body becomes a file NAME in the build context (`extra_files`), its
  variables expanded from the stage's ARG/ENV when the delimiter is unquoted.
`COPY --link` (a layering hint) is dropped. Everything else reaches the builder as written.

Invariant: instructions that need no change are passed through byte for byte.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field

from miles_env.errors import ConfigError

__all__ = ["Heredoc", "Instruction", "Dockerfile", "parse_dockerfile"]

_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z]+)\s*=\s*(.*?)\s*$")
_HEREDOC = re.compile(r"(?<!<)<<(?!<)(-?)\s*([\"']?)([A-Za-z_][\w.-]*)\2")
_VAR = re.compile(r"\$(?:\{([A-Za-z_]\w*)(?::?([-+])([^}]*))?\}|([A-Za-z_]\w*))")
_FROM_FLAG = re.compile(r"(--from=|--mount=\S*?\bfrom=)([^\s,]+)")
_DEFAULT_SHELL = ["/bin/sh", "-c"]
# Runs a `#!` body as a file: argv is [launcher, "sh", body]; the file is removed afterwards.
_SHEBANG_LAUNCHER = (
    'f=$(mktemp) && printf %s "$1" > "$f" && chmod 755 "$f" && "$f"; rc=$?; rm -f "$f"; exit $rc'
)


@dataclass(frozen=True, slots=True)
class Heredoc:
    name: str
    body: str  # with its trailing newline, as written (tabs kept)
    chomp: bool  # <<-: leading tabs stripped
    quoted: bool  # <<"EOF" / <<'EOF': no expansion

    def content(self) -> str:
        if not self.chomp:
            return self.body
        return "".join(line.lstrip("\t") for line in self.body.splitlines(keepends=True))


@dataclass(slots=True)
class Instruction:
    op: str  # upper case; "" for a comment or blank line kept as is
    args: str  # the instruction's arguments, continuation lines joined, heredoc bodies apart
    text: str  # the original text (all its physical lines)
    line: int  # 1-based line of the keyword
    heredocs: list[Heredoc] = field(default_factory=list)


def expand(text: str, env: dict[str, str]) -> str:
    """Docker's `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR:+alt}` (an unset name is empty)."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(4)
        value = env.get(name, "")
        if m.group(2) == "-":
            return value or m.group(3)
        if m.group(2) == "+":
            return m.group(3) if value else ""
        return value

    return _VAR.sub(sub, text)


def _pairs(args: str) -> dict[str, str]:
    """`ENV/ARG k=v k2="v 2"` (or the legacy `ENV k v`) as a dict; ARG without a default: ''."""
    try:
        words = _split_words(args)
    except ValueError:
        return {}
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return {k: v for k, _, v in (w.partition("=") for w in words)}


def _split_words(args: str) -> list[str]:
    return shlex.split(args, posix=True)


class Dockerfile:
    """A parsed Dockerfile; `render()` writes it back with the changes made to its instructions."""

    def __init__(self, instructions: list[Instruction], escape: str) -> None:
        self.instructions = instructions
        self.escape = escape

    def global_args(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for ins in self.instructions:
            if ins.op == "FROM":
                break
            if ins.op == "ARG":
                env.update({k: expand(v, env) for k, v in _pairs(ins.args).items()})
        return env

    def external_images(self) -> list[str]:
        """Each image the build pulls, as written after ARG expansion, in order, without repeats."""
        found: list[str] = []
        for _ins, images in self._walk():
            found += [i for i in images if i not in found]
        return found

    def point_images(self, names: dict[str, str]) -> None:
        """Replace each external image (as external_images() names it) by names[image]."""
        glob = self.global_args()
        for ins, images in self._walk():
            if not any(i in names for i in images):
                continue
            if ins.op == "FROM":
                flags, rest = _from_words(ins)
                ins.args = " ".join([*flags, names[expand(rest[0], glob)], *rest[1:]])
            else:
                ins.args = _FROM_FLAG.sub(lambda m: m.group(1) + names.get(m.group(2), m.group(2)), ins.args)
            ins.text = ""  # rendered from the new args

    def _walk(self) -> Iterator[tuple[Instruction, list[str]]]:
        """(instruction, the external images it names) for each instruction naming one."""
        stages: set[str] = set()
        glob = self.global_args()
        for ins in self.instructions:
            if ins.op == "FROM":
                _flags, rest = _from_words(ins)
                image = expand(rest[0], glob)
                external = image.lower() not in stages and image != "scratch"
                if len(rest) >= 3 and rest[1].lower() == "as":
                    stages.add(rest[2].lower())
                if external:
                    yield ins, [image]
            elif ins.op in ("COPY", "ADD", "RUN"):
                refs = [m.group(2) for m in _FROM_FLAG.finditer(ins.args)]
                refs = [r for r in refs if r.lower() not in stages and not r.isdigit()]
                if refs:
                    yield ins, refs

    def lower(self) -> dict[str, bytes]:
        """Lower BuildKit-only syntax in place; returns the files COPY heredocs need in the context."""
        extra: dict[str, bytes] = {}
        shell = list(_DEFAULT_SHELL)
        env: dict[str, str] = dict(self.global_args())
        for ins in self.instructions:
            if ins.op == "FROM":
                shell, env = list(_DEFAULT_SHELL), dict(self.global_args())
            elif ins.op == "SHELL":
                shell = json.loads(ins.args)
            elif ins.op in ("ENV", "ARG"):
                env.update({k: expand(v, env) for k, v in _pairs(ins.args).items()})
            if ins.op in ("COPY", "ADD") and "--link" in ins.args.split():
                ins.args = " ".join(w for w in ins.args.split(" ") if w not in ("--link", "--link=true"))
                ins.text = ""
            if not ins.heredocs:
                continue
            if ins.op == "RUN":
                ins.args = json.dumps(_run_argv(ins, shell))
            elif ins.op in ("COPY", "ADD"):
                _lower_copy(ins, env, extra)
            ins.heredocs, ins.text = [], ""
        return extra

    def render(self) -> str:
        out = []
        for ins in self.instructions:
            out.append(ins.text if ins.text or not ins.op else f"{ins.op} {ins.args}\n")
        return "".join(out)


def _from_words(ins: Instruction) -> tuple[list[str], list[str]]:
    """FROM's flags (--platform=...) and the rest (image [AS name])."""
    words = ins.args.split()
    rest = [w for w in words if not w.startswith("--")]
    if not rest:
        raise ConfigError(f"Dockerfile line {ins.line}: FROM names no image")
    return [w for w in words if w.startswith("--")], rest


def _run_argv(ins: Instruction, shell: list[str]) -> list[str]:
    flags = re.match(r"^((?:--\S+\s+)*)", ins.args)
    head = ins.args[flags.end() :] if flags else ins.args
    if flags and flags.group(1).strip():
        raise ConfigError(
            f"Dockerfile line {ins.line}: RUN {flags.group(1).strip()} with a here-document is not "
            "supported by the builders here"
        )
    only = _HEREDOC.fullmatch(head.strip())
    if only is not None and len(ins.heredocs) == 1:
        body = ins.heredocs[0].content()
        if body.startswith("#!"):
            return ["/bin/sh", "-c", _SHEBANG_LAUNCHER, "sh", body]
        return [*shell, body]
    script = head + "".join("\n" + h.body + h.name for h in ins.heredocs)
    return [*shell, script]


def _lower_copy(ins: Instruction, env: dict[str, str], extra: dict[str, bytes]) -> None:
    base = f".miles-env-heredoc/{ins.line}"
    args = ins.args
    for h in ins.heredocs:
        body = h.content() if h.quoted else expand(h.content(), env)
        extra[f"{base}/{h.name}"] = body.encode()
    args = _HEREDOC.sub(lambda m: f"{base}/{m.group(3)}", args)
    ins.args = args


def _logical_lines(lines: list[str], start: int, escape: str) -> tuple[str, int]:
    """Join an instruction's continuation lines from lines[start]; returns (joined, next index)."""
    parts: list[str] = []
    i = start
    while i < len(lines):
        raw = lines[i].rstrip("\r\n")
        i += 1
        if parts and (not raw.strip() or raw.lstrip().startswith("#")):
            continue  # comment and empty lines inside a continuation are dropped, as Docker does
        stripped = raw.rstrip()
        if stripped.endswith(escape):
            parts.append(stripped[: -len(escape)])
            continue
        parts.append(raw)
        break
    return " ".join(p.strip() for p in parts), i


def parse_dockerfile(text: str) -> Dockerfile:
    """Parse `text`; a here-document never closed is a ConfigError naming its line."""
    lines = text.splitlines(keepends=True)
    escape = "\\"
    out: list[Instruction] = []
    i = 0
    in_directives = True
    while i < len(lines):
        raw = lines[i]
        if in_directives and (m := _DIRECTIVE.match(raw.strip())) and m.group(1).lower() == "escape":
            escape = m.group(2) or "\\"
        if not raw.strip() or raw.lstrip().startswith("#"):
            out.append(Instruction("", "", raw, i + 1))
            i += 1
            continue
        in_directives = False
        start = i
        joined, i = _logical_lines(lines, i, escape)
        op, _, args = joined.strip().partition(" ")
        ins = Instruction(op.upper(), args.strip(), "", start + 1)
        if ins.op in ("RUN", "COPY", "ADD"):
            for m in _HEREDOC.finditer(ins.args):
                name, chomp, body = m.group(3), m.group(1) == "-", []
                while (
                    i < len(lines)
                    and (lines[i].rstrip("\r\n").lstrip("\t") if chomp else lines[i].rstrip("\r\n")) != name
                ):
                    body.append(lines[i])
                    i += 1
                if i >= len(lines):
                    raise ConfigError(f"Dockerfile line {start + 1}: here-document <<{name} is never closed")
                i += 1
                ins.heredocs.append(Heredoc(name, "".join(body), chomp, bool(m.group(2))))
        ins.text = "".join(lines[start:i])
        out.append(ins)
    return Dockerfile(out, escape)
