"""Where an environment came from: its distribution name and version, recorded with every result.

Concept: `env_distribution(env)` names the package an environment's code ships in, so an
Episode or a run config can say exactly which environment release produced it:

- an environment registered through the `miles_env.environments` entry points (or any class
  whose top-level module an installed distribution provides): that distribution's name and
  version from `importlib.metadata`;
- a native Harbor task directory (`harbor:/path`): `harbor-tasks` and `sha256:<16 hex>`, a hash
  of every file of every task directory (names and bytes), since the tasks are not a package;
- a worker-backed adapter (`verifiers:`, `hud:`...): the framework's name and the version its
  venv's lock file (`adapters/locks/<adapter>.txt`) pins;
- anything else (a module on `sys.path` that no distribution provides): its module name and
  version "unknown".

Invariant: the answer depends only on installed metadata and file contents; it is computed
once per environment instance (cached weakly), so recording it on every Episode costs a dict
lookup.
"""

from __future__ import annotations

import hashlib
import re
import weakref
from importlib.metadata import entry_points, packages_distributions, version
from importlib.resources import files
from pathlib import Path

from miles_env.environment import Environment

__all__ = ["env_distribution", "tree_hash"]

_CACHE: weakref.WeakKeyDictionary[Environment, dict[str, str]] = weakref.WeakKeyDictionary()


def tree_hash(paths: list[Path]) -> str:
    """`sha256:<16 hex>` over every file below `paths` (relative names and bytes, sorted)."""
    h = hashlib.sha256()
    for root in sorted(paths):
        for p in sorted(root.rglob("*")):
            if p.is_file():
                h.update(f"{root.name}/{p.relative_to(root)}".encode() + b"\0" + p.read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()[:16]


def _from_entry_points(env: Environment) -> dict[str, str] | None:
    module = type(env).__module__
    for ep in entry_points(group="miles_env.environments"):
        if ep.dist is not None and (ep.name == env.name or ep.module == module):
            return {"name": ep.dist.name, "version": ep.dist.version}
    return None


def _from_module(env: Environment) -> dict[str, str]:
    module = type(env).__module__
    dists = packages_distributions().get(module.split(".")[0], [])
    if dists:
        return {"name": dists[0], "version": version(dists[0])}
    return {"name": module, "version": "unknown"}


def _locked_version(adapter: str) -> str:
    lock = files("miles_env.adapters") / "locks" / f"{adapter}.txt"
    if lock.is_file():
        pin = re.search(rf"^{re.escape(adapter)}==(\S+)$", lock.read_text(), flags=re.M)
        if pin:
            return pin.group(1)
    return "unknown"


def _adapter_distribution(env: Environment) -> dict[str, str] | None:
    from miles_env.adapters import SplitEnvironment  # lazily: core never imports an adapter at load
    from miles_env.adapters.harbor import HarborTasksEnvironment, find_task_dirs
    from miles_env.adapters.worker_env import WorkerEnvironment

    inner = env.inner if isinstance(env, SplitEnvironment) else env
    if isinstance(inner, HarborTasksEnvironment):
        return {"name": "harbor-tasks", "version": tree_hash(find_task_dirs(inner.path))}
    if isinstance(inner, WorkerEnvironment):
        return {"name": inner.adapter, "version": _locked_version(inner.adapter)}
    return None


def _compute(env: Environment) -> dict[str, str]:
    if type(env).__module__.startswith("miles_env.adapters"):
        found = _adapter_distribution(env)
        if found is not None:
            return found
    return _from_entry_points(env) or _from_module(env)


def env_distribution(env: Environment) -> dict[str, str]:
    """`{"name": ..., "version": ...}` of the package (or task files) `env` comes from."""
    try:
        return dict(_CACHE[env])
    except (KeyError, TypeError):
        pass
    try:
        found = _compute(env)
    except (OSError, ValueError, ImportError) as e:  # recording provenance never fails an episode
        found = {"name": type(env).__module__, "version": f"unknown ({type(e).__name__})"}
    try:
        _CACHE[env] = found
    except TypeError:  # an environment that cannot be weakly referenced: computed each time
        pass
    return dict(found)
