"""What kind of directory `miles-env view` was pointed at, and where its files are.

Three layouts are read, all written by other commands (never by the viewer):
- a training run (`miles-env train`): config.yaml, metrics.jsonl, queue.db (train episodes with
  their token arrays), eval_episodes.jsonl (eval episodes, tokens in the store),
  failed_episodes.jsonl (train episodes that failed and never reached the queue), sessions/;
- an eval output (`miles-env eval --out`): episodes.jsonl (full episodes), summary.json, sessions/;
- a proxy store (`miles-env proxy serve --store`): one journal per session (+ export snapshots).

Invariant: the viewer never writes into the directory. SQLite is opened with `mode=ro`, journals
are read as bytes and a torn last line is skipped, not repaired (tito/store.py would cut it off).
"""

from __future__ import annotations

import enum
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from miles_env.errors import ConfigError

__all__ = ["Kind", "Layout", "detect", "connect_ro"]


class Kind(enum.StrEnum):
    TRAIN = "train"
    EVAL = "eval"
    STORE = "store"


@dataclass(frozen=True, slots=True)
class Layout:
    root: Path
    kind: Kind

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def queue(self) -> Path:
        return self.root / "queue.db"

    @property
    def eval_episodes(self) -> Path:
        return self.root / ("eval_episodes.jsonl" if self.kind is Kind.TRAIN else "episodes.jsonl")

    @property
    def failed_episodes(self) -> Path:
        return self.root / "failed_episodes.jsonl"

    @property
    def store(self) -> Path:
        return self.root if self.kind is Kind.STORE else self.root / "sessions"

    def config(self) -> dict[str, Any]:
        """The run's resolved config.yaml ({} when there is none or it is unreadable)."""
        path = self.root / "config.yaml"
        try:
            data = yaml.safe_load(path.read_text()) if path.is_file() else None
        except (OSError, yaml.YAMLError):
            return {}
        return data if isinstance(data, dict) else {}


def detect(root: Path) -> Layout:
    """The layout of `root`; a ConfigError naming the path when it is none of the three."""
    if not root.is_dir():
        raise ConfigError(f"{root}: not a directory")
    if (
        (root / "queue.db").is_file()
        or (root / "metrics.jsonl").is_file()
        or (root / "config.yaml").is_file()
    ):
        return Layout(root, Kind.TRAIN)
    if (root / "episodes.jsonl").is_file():
        return Layout(root, Kind.EVAL)
    if any(root.glob("*.jsonl")) or (root / "sessions").is_dir():
        return Layout(root / "sessions" if (root / "sessions").is_dir() else root, Kind.STORE)
    raise ConfigError(
        f"{root}: not a run directory (no queue.db, metrics.jsonl, episodes.jsonl or session journals)"
    )


def connect_ro(path: Path) -> sqlite3.Connection:
    """A read-only connection: a running `train` keeps writing, the viewer never takes a write lock."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0, check_same_thread=False)
    conn.execute("PRAGMA query_only=1")
    return conn
