"""The environment registry: entry points plus explicit `module.path:attr` references.

Concept: an environment package registers itself in the entry-point group
`miles_env.environments`; the entry point resolves to an Environment subclass or
a zero-argument factory returning an Environment. Environments not installed as
packages load from "module.path:attr". A name whose prefix is an adapter's
("verifiers:<ref>", "harbor:/path") goes to that adapter, looked up in the adapter
family's one table (`miles_env.adapters.ADAPTERS`, a PluginTable), imported lazily.

Invariant: `load_environment` returns an environment whose tasks have been
validated (Task instances, in the split they are listed under, unique ids, the
environment's own name, well-formed check lists), or raises: RegistryError for an
unknown name or an entry point that fails to load, TaskError for a bad task.

Lifecycle: stateless; every call re-reads the installed entry points, so a
package installed in another process shows up in the next call of a new process.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from pydantic import ValidationError

from miles_env.checks import format_validation_error, parse_checks
from miles_env.environment import Environment
from miles_env.errors import ConfigError, RegistryError, TaskError
from miles_env.limits import TaskLimits, declare
from miles_env.types import Task

__all__ = [
    "ENTRY_POINT_GROUP",
    "EnvInfo",
    "list_environments",
    "load_environment",
    "validate_environment",
    "make_task",
]

ENTRY_POINT_GROUP = "miles_env.environments"


@dataclass(frozen=True, slots=True)
class EnvInfo:
    name: str
    source: str  # "<distribution> <version>" or "module"
    description: str = ""
    n_tasks: dict[str, int] = field(default_factory=dict)  # split -> number of tasks
    error: str | None = None  # set when the environment failed to load

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "description": self.description,
            "n_tasks": dict(self.n_tasks),
            "error": self.error,
        }


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _source(ep: EntryPoint) -> str:
    dist = ep.dist
    return f"{dist.name} {dist.version}" if dist is not None else "unknown"


def _instantiate(obj: Any, where: str) -> Environment:
    """Turn an Environment subclass, factory or instance into an instance."""
    if isinstance(obj, Environment):
        return obj
    if not callable(obj):
        raise RegistryError(f"{where}: {obj!r} is neither an Environment subclass nor a factory")
    if inspect.isclass(obj) and not issubclass(obj, Environment):
        raise RegistryError(f"{where}: class {obj.__name__} is not an Environment subclass")
    env = obj()
    if not isinstance(env, Environment):
        raise RegistryError(f"{where}: factory returned {type(env).__name__}, not an Environment")
    return env


def _load_entry_point(ep: EntryPoint) -> Environment:
    where = f"entry point {ep.name!r} ({ep.value}) of distribution {_source(ep)!r}"
    try:
        obj = ep.load()
        env = _instantiate(obj, where)
    except RegistryError:
        raise
    except Exception as e:  # an import or constructor failure in someone else's package
        raise RegistryError(f"{where} failed to load: {type(e).__name__}: {e}") from e
    if not env.name:
        env.name = ep.name
    return env


def _load_reference(ref: str) -> Environment:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise RegistryError(f"environment reference {ref!r}: expected 'module.path:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        env = _instantiate(obj, f"environment {ref!r}")
    except RegistryError:
        raise
    except Exception as e:
        raise RegistryError(f"environment {ref!r} failed to load: {type(e).__name__}: {e}") from e
    if not env.name:
        env.name = attr.rsplit(".", 1)[-1]
    return env


def _is_adapter_name(name: str) -> bool:
    from miles_env.adapters import is_adapter_name  # lazily: core never imports an adapter at load

    return is_adapter_name(name)


def load_environment(name: str, *, validate: bool = True) -> Environment:
    """An environment by entry-point name or by "module.path:attr"."""
    if _is_adapter_name(name):  # "verifiers:<env>", "harbor:/path": a framework adapter
        from miles_env.adapters import load_adapter_environment

        env = load_adapter_environment(name)
    elif ":" in name:
        env = _load_reference(name)
    else:
        eps = _entry_points()
        if name not in eps:
            known = sorted(eps)
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise RegistryError(
                f"unknown environment {name!r}{hint} (known: {', '.join(known) or 'none installed'}; "
                "or pass 'module.path:attr')"
            )
        env = _load_entry_point(eps[name])
    if validate:
        validate_environment(env)
    return env


def _split_tasks(env: Environment, split: str) -> list[Task]:
    try:
        return list(env.tasks(split))
    except ValidationError as e:
        raise TaskError(f"environment {env.name!r}, split {split!r}: {format_validation_error(e)}") from None


def validate_environment(env: Environment) -> dict[str, int]:
    """Check every task of every split; return the number of tasks per split."""
    seen: dict[str, str] = {}
    counts: dict[str, int] = {}
    for split in env.splits:
        tasks = _split_tasks(env, split)
        for i, task in enumerate(tasks):
            if not isinstance(task, Task):
                raise TaskError(f"environment {env.name!r}, split {split!r}: item {i} is not a Task")
            if task.split != split:
                raise TaskError(f"task {task.id!r}: field 'split' is {task.split!r}, listed under {split!r}")
            if task.env != env.name:
                raise TaskError(f"task {task.id!r}: field 'env' is {task.env!r}, want {env.name!r}")
            if task.id in seen:
                raise TaskError(
                    f"task {task.id!r}: field 'id' is duplicated (splits {seen[task.id]!r}, {split!r})"
                )
            seen[task.id] = split
            if "checks" in task.verifier:
                parse_checks(task)
        counts[split] = len(tasks)
    return counts


def make_task(*, limits: Mapping[str, Any] | None = None, **fields: Any) -> Task:
    """Build a Task; a bad field raises TaskError naming the task id and the field.

    `limits`: the task's own limits (miles_env.limits.TaskLimits: cpus, memory_mb or "2G",
    disk_mb, max_procs, agent_timeout_s, verifier_timeout_s, network), set on its sandbox spec.
    """
    try:
        task = Task(**fields)
        if limits is None:
            return task
        declared = TaskLimits.model_validate(limits)
        return task.model_copy(update={"sandbox": declare(task.sandbox, declared)})
    except ConfigError as e:
        raise TaskError(f"task {fields.get('id', '<no id>')!r}: limits.{e}") from None
    except ValidationError as e:
        raise TaskError(f"task {fields.get('id', '<no id>')!r}: {format_validation_error(e)}") from None


def _info(name: str, source: str, load: Any) -> EnvInfo:
    try:
        env = load()
        counts = validate_environment(env)
    except (RegistryError, TaskError) as e:
        return EnvInfo(name=name, source=source, error=str(e))
    return EnvInfo(name=name, source=source, description=env.description, n_tasks=counts)


def _adapter_infos() -> list[EnvInfo]:
    """Environments of installed adapter venvs, named from files only (no worker is started)."""
    from miles_env.adapters.discover import discover

    return [
        EnvInfo(e.name, f"adapter:{e.framework}", e.description, dict(e.n_tasks), e.error) for e in discover()
    ]


def list_environments(extra: Sequence[str] = (), *, adapters: bool = True) -> list[EnvInfo]:
    """Installed environments (sorted by name) plus explicitly given "module:attr" ones.

    An environment that fails to load is listed with `error` set instead of raising,
    so one broken package does not hide the others. With `adapters`, the environments
    of installed framework venvs follow (source `adapter:<framework>`; task counts only
    where known without starting a worker, else empty).
    """
    infos = [
        _info(name, _source(ep), lambda ep=ep: _load_entry_point(ep))
        for name, ep in sorted(_entry_points().items())
    ]
    infos += [
        _info(
            ref,
            "adapter" if _is_adapter_name(ref) else "module",
            lambda ref=ref: load_environment(ref, validate=False),
        )
        for ref in extra
    ]
    if adapters:
        listed = {i.name for i in infos}
        infos += [i for i in _adapter_infos() if i.name not in listed]
    return infos
