"""The CLI's error edge: a known failure is one line on stderr and exit code 2, never a traceback.

Concept: commands raise, they do not print their errors. `EdgeGroup`, the class of the top-level
`miles-env` group, wraps the parsing and the invocation of every subcommand and translates, once:
- MilesEnvError (config, registry, sandbox, engine, queue...)  -> its message
- ModuleNotFoundError of a package outside miles-env           -> the package and the extra to install
- OSError (a missing, unreadable or wrong file; a refused bind) -> the path and the reason
- pydantic.ValidationError (a bad value that reached a model)  -> each field and what is wrong
- click usage errors (bad option value, missing argument)      -> the message and where to find --help
Anything else is a bug and keeps its traceback; MILES_ENV_TRACEBACK=1 keeps it for all of them.

Invariant: what reaches stderr here is exactly one line, "error: ...", whatever the terminal
width (plain typer.echo, not rich), so scripts can grep it and people can read it.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pydantic
import typer
from typer.core import TyperGroup

from miles_env.errors import MilesEnvError

__all__ = ["EdgeGroup", "one_line"]

# typer 0.29 vendors click (typer._click); older typer uses click itself: take the classes from
# wherever typer's own BadParameter lives.
_click_exceptions = sys.modules[typer.BadParameter.__module__]
_UsageError: type[Exception] = _click_exceptions.UsageError
_NoArgsIsHelp: type[Exception] = getattr(_click_exceptions, "NoArgsIsHelpError", _UsageError)
_OURS = {"miles_env"}
_DIST_OF_MODULE = {"megatron": "megatron-core", "yaml": "pyyaml"}  # import name -> distribution


class EdgeGroup(TyperGroup):
    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        with _translated():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        with _translated():
            return super().invoke(ctx)


@contextmanager
def _translated() -> Iterator[None]:
    """A known error leaves as one stderr line and click's Exit (2, or a usage error's own code)."""
    try:
        yield
    except Exception as exc:
        line = None if os.environ.get("MILES_ENV_TRACEBACK") else one_line(exc)
        if line is None:
            raise
        typer.echo(f"error: {line}", err=True)
        code: int = exc.exit_code if isinstance(exc, _UsageError) else 2  # type: ignore[attr-defined]
        raise typer.Exit(code) from None


def one_line(exc: BaseException) -> str | None:
    """The one-line message for a known error, None for anything else (a bug: keep its traceback)."""
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return one_line(exc.exceptions[0])  # a single failure inside a task group
    if isinstance(exc, _NoArgsIsHelp) and _NoArgsIsHelp is not _UsageError:
        return None  # click prints the help
    if isinstance(exc, _UsageError):
        usage: Any = exc  # a click UsageError (typed loosely: typer may vendor click)
        where = usage.ctx.command_path if usage.ctx is not None else "miles-env"
        text = f"{where}: {usage.format_message()} (see '{where} --help')"
    elif isinstance(exc, MilesEnvError):
        text = str(exc) or type(exc).__name__
    elif isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] not in _OURS:
        text = _missing_package(exc.name.split(".")[0])
    elif isinstance(exc, pydantic.ValidationError):
        from miles_env.config import error_lines  # the run config's sections read as in a config file

        text = f"invalid {exc.title}: " + "; ".join(error_lines(exc))
    elif isinstance(exc, OSError):
        where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        text = f"{where}: {exc.strerror or exc}" if where else str(exc) or type(exc).__name__
    else:
        return None
    return _flatten(text)


def _flatten(text: str) -> str:
    """Several lines (a YAML parser's pointer, a list of fields) joined into one."""
    lines = [line.strip() for line in text.splitlines()]
    return "; ".join(line for line in lines if line.strip("^ ")).replace(":; ", ": ")  # "header:" + items


def _missing_package(module: str) -> str:
    text = f"the optional package {module!r} is not installed"
    extra = _extra_providing(module)
    return f"{text}: pip install 'miles-env[{extra}]'" if extra else text


def _extra_providing(module: str) -> str | None:
    """The miles-env extra whose requirements name the distribution that provides `module`."""
    want = _norm(_DIST_OF_MODULE.get(module, module))
    try:
        requires = importlib.metadata.requires("miles-env") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requires:
        name = re.match(r"\s*([A-Za-z0-9._-]+)", req)
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", req)
        if name and extra and _norm(name.group(1)) == want:
            return extra.group(1)
    return None


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()
