"""Atomic, rotating checkpoints: ROOT/step_00000012/{state.pt, trainer.json}.

Invariant: a directory named step_* is complete (it is written under a .tmp-
name, fsynced, then renamed), so the newest one is always safe to resume from.
The `extra` dict is where the training loop records what the step trained on
(episode ids), which is what lets the replay queue ack exactly that on resume.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from miles_env.jsonio import dumps

__all__ = ["write_checkpoint", "latest_checkpoint", "read_checkpoint"]

_PREFIX = "step_"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    with open(tmp / "trainer.json", "w") as f:
        f.write(dumps({"step": step, **meta}))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # re-training a step after a resume replaces its older copy
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    for old in sorted(root.glob(f"{_PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    found = sorted(p for p in root.glob(f"{_PREFIX}*") if (p / "trainer.json").is_file())
    return found[-1] if found else None


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    meta = json.loads((path / "trainer.json").read_text())
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    return state, meta
