"""Which replay queue a run uses: `queue: {kind: sqlite}` (the default) or `{kind: redis, url: ...}`.

Concept: each backend owns a small config (pydantic, stdlib only, so the run config can compose it
without importing a backend); `QueueConfig` is their union, discriminated by `kind`, so a bad key
fails at load time with its path. `build_queue` opens the configured backend for a run directory,
importing it only then (the Redis client is the optional `scale` extra).

SQLite keeps the queue in RUN_DIR/queue.db. Redis keeps it on a server shared by every rollout and
trainer host, under a key prefix that defaults to "miles-env:" plus the run directory's name, so a
resumed run (same directory) finds its queue and two runs on one server do not mix.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from miles_env.queue.contract import ReplayQueue

__all__ = ["SqliteQueueConfig", "RedisQueueConfig", "QueueConfig", "build_queue"]


class SqliteQueueConfig(BaseModel):
    """The embedded queue: one SQLite file (WAL) in the run directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["sqlite"] = "sqlite"
    file: str = Field("queue.db", description="database file, relative to the run directory")
    synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL", description="SQLite's fsync level: NORMAL (WAL) may lose the last commits on power loss"
    )


class RedisQueueConfig(BaseModel):
    """The shared queue: a Redis server with its append-only file (AOF) on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["redis"]
    url: str = Field(
        "redis://127.0.0.1:6379/0", description="redis:// or rediss:// URL (may carry a password)"
    )
    prefix: str | None = Field(
        None, description='key prefix of this run\'s queue; default "miles-env:<run directory name>"'
    )
    require_aof: bool = Field(True, description="refuse a server without appendonly yes (a restart loses it)")
    retry_s: float = Field(30.0, ge=0, description="how long to ride out an unreachable server (a restart)")


QueueConfig = Annotated[SqliteQueueConfig | RedisQueueConfig, Field(discriminator="kind")]


def build_queue(
    cfg: SqliteQueueConfig | RedisQueueConfig,
    run_dir: Path,
    *,
    group_size: int | None,
    max_pending_groups: int,
) -> ReplayQueue:
    """Open (or create) the run's replay queue. `group_size=None` opens an existing one."""
    if isinstance(cfg, SqliteQueueConfig):
        from miles_env.queue.sqlite import SqliteReplayQueue

        return SqliteReplayQueue(
            run_dir / cfg.file,
            group_size=group_size,
            max_pending_groups=max_pending_groups,
            synchronous=cfg.synchronous,
        )
    from miles_env.queue.redis import RedisReplayQueue

    return RedisReplayQueue(
        cfg.url,
        prefix=cfg.prefix or f"miles-env:{run_dir.resolve().name}",
        group_size=group_size,
        max_pending_groups=max_pending_groups,
        require_aof=cfg.require_aof,
        retry_s=cfg.retry_s,
    )
