"""The task counts `miles-env env list` shows: a small cache, filled by the environments themselves.

Concept: an adapter environment's `tasks()` lists its tasks through its worker and records how
many per split (`remember_counts`); discovery (discover.py) reads them back (`cached_counts`)
without starting a worker. One JSON file under the adapters' cache root.

Invariant: the cache is keyed by environment name and a stamp (mtimes of the venv marker and of
the environment's file), so a reinstalled framework or an edited taskset is counted afresh; a
cache that cannot be read or written only costs a count, never an error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from miles_env.adapters.venv import MARKER, cache_root, venv_dir

__all__ = ["remember_counts", "cached_counts"]


def _counts_file() -> Path:
    return cache_root() / "env-counts.json"


def _stamp(name: str) -> str:
    """mtimes of the framework's venv marker and of the file the name points at."""
    framework, _, ref = name.partition(":")
    parts = []
    for p in (venv_dir(framework) / MARKER, Path(ref.split("?", 1)[0].rsplit(":", 1)[0])):
        try:
            parts.append(str(os.stat(p).st_mtime_ns))
        except OSError:
            parts.append("-")
    return "/".join(parts)


def _load_counts() -> dict[str, dict[str, object]]:
    try:
        data = json.loads(_counts_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def remember_counts(name: str, counts: dict[str, int]) -> None:
    """Record an adapter environment's task counts (called after its worker listed them)."""
    data = _load_counts()
    data[name] = {"stamp": _stamp(name), "n_tasks": counts}
    path = _counts_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: a concurrent reader sees the old or the new file
    except OSError:
        pass  # a cache that cannot be written only costs a count in `env list`


def cached_counts(name: str) -> dict[str, int]:
    entry = _load_counts().get(name)
    if not isinstance(entry, dict) or entry.get("stamp") != _stamp(name):
        return {}
    counts = entry.get("n_tasks")
    return {str(k): int(v) for k, v in counts.items()} if isinstance(counts, dict) else {}
