"""`miles-env queue`: inspect a run's replay queue (RUN_DIR/queue.db)."""

from __future__ import annotations

from pathlib import Path

import typer

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

    from miles_env.queue import SqliteReplayQueue

    db = run_dir if run_dir.suffix == ".db" else run_dir / "queue.db"
    if not db.is_file():
        typer.echo(f"no replay queue at {db}", err=True)
        raise typer.Exit(2)
    queue = SqliteReplayQueue(db)
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
