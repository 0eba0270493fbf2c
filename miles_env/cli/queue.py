"""`miles-env queue`: inspect a run's replay queue (RUN_DIR/queue.db, or the Redis queue its config names).

A run directory's resolved config.yaml says which backend the run used; `queue: {kind: redis}`
is opened on its server under the run's key prefix, anything else is RUN_DIR/queue.db.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from miles_env.queue.config import RedisQueueConfig

app = typer.Typer(no_args_is_help=True, help="Inspect the replay queue of a run directory.")


@app.callback()
def _group() -> None:
    """Keep `queue` a command group even while it has a single command."""


@app.command("stats")
def stats_command(
    run_dir: Path = typer.Argument(..., help="run directory holding queue.db (or the .db file itself)"),
    as_json: bool = typer.Option(False, "--json", help="print the stats as JSON"),
) -> None:
    """Groups and episodes by state, stale drops, quarantined (corrupted) episodes."""
    from rich.console import Console
    from rich.table import Table

    from miles_env.queue.contract import ReplayQueue
    from miles_env.queue.sqlite import SqliteReplayQueue

    queue: ReplayQueue
    resolved = _resolved(run_dir)
    redis = _redis_config(resolved)
    if redis is not None:
        from miles_env.queue.config import build_queue

        db = f"{redis.url.rpartition('@')[2]} ({redis.prefix or 'miles-env:' + run_dir.resolve().name})"
        pending = 2 * int((resolved.get("rollout") or {}).get("groups_per_step", 4))  # as the job sets it
        queue = build_queue(redis, run_dir, group_size=None, max_pending_groups=pending)
    else:
        db = str(run_dir if run_dir.suffix == ".db" else run_dir / "queue.db")
        if not Path(db).is_file():
            typer.echo(f"no replay queue at {db}", err=True)
            raise typer.Exit(2)
        queue = SqliteReplayQueue(Path(db))
    try:
        stats = queue.stats()
    finally:
        queue.close()
    if as_json:
        typer.echo(stats.model_dump_json(indent=2))
        return
    table = Table(title=f"replay queue {db}")
    table.add_column("state")
    table.add_column("groups", justify="right")
    table.add_column("episodes", justify="right")
    for state in ("open", "pending", "leased", "acked", "stale", "quarantined"):
        table.add_row(state, str(getattr(stats, f"{state}_groups")), str(stats.episodes.get(state, 0)))
    console = Console()
    console.print(table)
    console.print(
        f"group_size={stats.group_size}  complete groups={stats.complete_groups}  "
        f"stale dropped episodes={stats.stale_dropped_episodes}"
    )
    if stats.quarantined_episodes:
        console.print(
            f"[red]quarantined episodes={stats.quarantined_episodes}[/]: their stored bytes failed the "
            "checksum; their groups are never trained"
        )


def _resolved(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config (RUN_DIR/config.yaml, written by `train`), or {}."""
    import yaml

    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _redis_config(resolved: dict[str, Any]) -> RedisQueueConfig | None:
    """The run's Redis queue config, if its resolved config names one."""
    from miles_env.queue.config import RedisQueueConfig

    section = resolved.get("queue") or {}
    return RedisQueueConfig.model_validate(section) if section.get("kind") == "redis" else None
