"""What every placed engine serves now, kept aside so that a replacement can load the same.

Concept: after each weight sync `PlacedEngines` (engines.py) records a `Served`: the version and
the export (or LoRA adapter folder) every engine loaded. The trainer's next export overwrites its
folder, so `keep_served` hard-links the export to `<path>.served` first (a copy where the file
system has no hard links); a replacement engine (engine_faults.py) loads that.

Invariant: `<path>.served` is always a whole export: it is built under a temporary name and
renamed over the one kept before.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Served", "keep_served"]


@dataclass(frozen=True, slots=True)
class Served:
    """What the last weight sync loaded on every engine: a replacement loads the same before joining."""

    version: int
    path: Path  # a weight export (kept aside by keep_served) or a LoRA adapter folder
    lora_name: str | None = None  # set: `path` is an adapter loaded under this name


def keep_served(path: Path) -> Path:
    """Hard-link the export at `path` (a folder or a file) to `<path>.served`, replacing the one
    kept before; copies where the file system has no hard links. Returns the kept path."""
    kept = path.with_name(f"{path.name}.served")
    tmp = path.with_name(f".{path.name}.served-tmp")
    _remove(tmp)
    if path.is_dir():
        tmp.mkdir(parents=True)
        for f in path.iterdir():
            _link(f, tmp / f.name)
    else:
        _link(path, tmp)
    _remove(kept)
    os.rename(tmp, kept)
    return kept


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
