"""A small declarative verifier language, stored in `Task.verifier`.

Concept: a task's verifier data is `{"checks": [...]}`, each check a typed spec
(file_exists, file_absent, file_equals, file_contains, file_mode, command). They
are validated once with pydantic (extra="forbid"); a malformed check becomes a
TaskError naming the task id and the field path.

Invariant: every check runs *inside* the sandbox through `exec` with an argv list
(no host file access, no shell quoting of user paths), so the same checks work on
every provider. The reward is 1.0 only when all checks pass; `details` lists each
check with pass/fail and a short reason, plus the partial-credit fraction.

Lifecycle: `parse_checks(task)` at load time (the registry validates every task),
`await run_checks(task, sandbox)` in `Environment.verify`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from miles_env.environment import Environment, Transcript
from miles_env.errors import TaskError
from miles_env.types import Reward, Task

if TYPE_CHECKING:
    from miles_env.sandbox import Sandbox

__all__ = [
    "Check",
    "VerifierSpec",
    "ChecksEnvironment",
    "parse_checks",
    "run_checks",
    "format_validation_error",
]

_CHECK_TIMEOUT_S = 30.0


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileExists(_Spec):
    kind: Literal["file_exists"]
    path: str = Field(min_length=1)
    type: Literal["any", "file", "dir"] = "any"


class FileAbsent(_Spec):
    kind: Literal["file_absent"]
    path: str = Field(min_length=1)


class FileEquals(_Spec):
    kind: Literal["file_equals"]
    path: str = Field(min_length=1)
    text: str
    strip: bool = False  # compare after stripping surrounding whitespace on both sides


class FileContains(_Spec):
    kind: Literal["file_contains"]
    path: str = Field(min_length=1)
    text: str = Field(min_length=1)
    regex: bool = False  # `text` is a Python regular expression (re.search, MULTILINE)
    negate: bool = False  # pass when the text is *not* present


class FileMode(_Spec):
    kind: Literal["file_mode"]
    path: str = Field(min_length=1)
    executable: bool | None = None  # by the sandbox user
    mode: str | None = Field(None, pattern=r"^[0-7]{3,4}$")  # exact octal permission bits


class Command(_Spec):
    kind: Literal["command"]
    cmd: str = Field(min_length=1)  # run with `sh -c` in the workdir
    exit_code: int | None = 0  # None: any exit code
    stdout_equals: str | None = None
    stdout_contains: str | None = None
    strip: bool = True  # strip surrounding whitespace before stdout_equals
    timeout: float = Field(_CHECK_TIMEOUT_S, gt=0)


Check = Annotated[
    FileExists | FileAbsent | FileEquals | FileContains | FileMode | Command,
    Field(discriminator="kind"),
]


class VerifierSpec(_Spec):
    checks: list[Check] = Field(min_length=1)


_SPEC_ADAPTER = TypeAdapter(VerifierSpec)


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """`field.path: message` for each error, the path joined with dots and [i]."""
    parts = []
    for e in err.errors():
        path = prefix
        for loc in e["loc"]:
            if isinstance(loc, int):
                path += f"[{loc}]"
            else:
                path += f".{loc}" if path else str(loc)
        parts.append(f"{path or '<root>'}: {e['msg']}")
    return "; ".join(parts)


def parse_checks(task: Task) -> VerifierSpec:
    """Validate `task.verifier` as a check list; TaskError names the task and field."""
    try:
        return _SPEC_ADAPTER.validate_python(task.verifier)
    except ValidationError as e:
        raise TaskError(f"task {task.id!r}: {format_validation_error(e, 'verifier')}") from None


def _trim(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


async def _read(sb: Sandbox, path: str) -> str | None:
    res = await sb.exec(["cat", "--", path], timeout=_CHECK_TIMEOUT_S)
    return res.stdout if res.exit_code == 0 else None


async def _run_one(check: Any, sb: Sandbox) -> tuple[bool, str]:
    """(passed, reason) for one check."""
    if isinstance(check, FileExists):
        flag = {"any": "-e", "file": "-f", "dir": "-d"}[check.type]
        res = await sb.exec(["test", flag, check.path], timeout=_CHECK_TIMEOUT_S)
        what = "path" if check.type == "any" else check.type
        return res.exit_code == 0, ("exists" if res.exit_code == 0 else f"no such {what}")
    if isinstance(check, FileAbsent):
        res = await sb.exec(["test", "-e", check.path], timeout=_CHECK_TIMEOUT_S)
        return res.exit_code != 0, ("absent" if res.exit_code != 0 else "still exists")
    if isinstance(check, FileEquals):
        text = await _read(sb, check.path)
        if text is None:
            return False, "cannot read file"
        got, want = (text.strip(), check.text.strip()) if check.strip else (text, check.text)
        return got == want, ("content matches" if got == want else f"content is {_trim(got)!r}")
    if isinstance(check, FileContains):
        text = await _read(sb, check.path)
        if text is None:
            return False, "cannot read file"
        found = bool(re.search(check.text, text, re.M)) if check.regex else check.text in text
        ok = found != check.negate
        return ok, f"{check.text!r} {'found' if found else 'not found'}"
    if isinstance(check, FileMode):
        return await _mode(check, sb)
    assert isinstance(check, Command)
    return await _command(check, sb)


async def _mode(check: FileMode, sb: Sandbox) -> tuple[bool, str]:
    res = await sb.exec(["stat", "-c", "%a", "--", check.path], timeout=_CHECK_TIMEOUT_S)
    if res.exit_code != 0:
        return False, "no such file"
    mode = res.stdout.strip()
    if check.mode is not None and int(mode, 8) != int(check.mode, 8):
        return False, f"mode is {mode}, want {check.mode}"
    if check.executable is not None:
        ex = (await sb.exec(["test", "-x", check.path], timeout=_CHECK_TIMEOUT_S)).exit_code == 0
        if ex != check.executable:
            return False, f"{'is' if ex else 'not'} executable (mode {mode})"
    return True, f"mode {mode}"


async def _command(check: Command, sb: Sandbox) -> tuple[bool, str]:
    res = await sb.exec(["sh", "-c", check.cmd], timeout=check.timeout)
    if res.timed_out:
        return False, f"timed out after {check.timeout:g}s"
    if check.exit_code is not None and res.exit_code != check.exit_code:
        err = _trim(res.stderr.strip())
        return False, f"exit code {res.exit_code}, want {check.exit_code}" + (f": {err}" if err else "")
    out = res.stdout.strip() if check.strip else res.stdout
    if check.stdout_equals is not None:
        want = check.stdout_equals.strip() if check.strip else check.stdout_equals
        if out != want:
            return False, f"stdout is {_trim(out)!r}, want {_trim(want)!r}"
    if check.stdout_contains is not None and check.stdout_contains not in res.stdout:
        return False, f"stdout lacks {_trim(check.stdout_contains)!r}"
    return True, f"exit code {res.exit_code}"


def _target(check: Any) -> str:
    return check.cmd if isinstance(check, Command) else check.path


async def run_checks(task: Task, sandbox: Sandbox) -> Reward:
    """Run every check of `task` in `sandbox`; score 1.0 only when all pass."""
    spec = parse_checks(task)
    rows: list[dict[str, Any]] = []
    for check in spec.checks:  # sequential: later checks may read what earlier ones saw
        passed, reason = await _run_one(check, sandbox)
        rows.append({"kind": check.kind, "target": _target(check), "passed": passed, "reason": reason})
    n_pass = sum(r["passed"] for r in rows)
    total = len(rows)
    return Reward(
        score=1.0 if n_pass == total else 0.0,
        details={"checks": rows, "passed": n_pass, "total": total, "fraction": n_pass / total},
    )


class ChecksEnvironment(Environment):
    """An Environment whose tasks are graded by `Task.verifier` check lists."""

    async def verify(self, task: Task, sandbox: Sandbox, transcript: Transcript) -> Reward:
        return await run_checks(task, sandbox)
