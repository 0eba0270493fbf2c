"""`miles-env tito audit RUN_DIR`: re-check a proxy store for drift between samples and engine records.

RUN_DIR is the store itself or a run dir of `miles-env train` / `eval` (which keep
the store under RUN_DIR/sessions). Prints a summary and drift counts by kind, then
each drift; exits 1 on any drift, 2 when RUN_DIR holds no store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["app"]

app = typer.Typer(no_args_is_help=True, help="TITO proxy tools (audit of stored trajectories).")


@app.callback()
def _group() -> None:
    """TITO proxy tools."""


@app.command("audit")
def audit_command(
    run_dir: Annotated[Path, typer.Argument(help="proxy store, or a run dir holding it under sessions/")],
    limit: Annotated[int, typer.Option(help="drifts to list in full")] = 20,
) -> None:
    """Re-check every stored trajectory; exit 1 on drift."""
    from miles_env.tito.audit import audit, resolve_store

    store = resolve_store(run_dir)
    if not store.is_dir():
        typer.echo(f"{run_dir}: no proxy store here (neither a store nor a dir with sessions/)", err=True)
        raise typer.Exit(2)
    r = audit(store)
    typer.echo(
        f"store {r.store_dir}: {r.sessions} sessions, {r.branches} branches, {r.turns} turns, "
        f"{r.sampled_tokens} sampled tokens, {r.snapshots} export snapshots, "
        f"{r.undelivered} turns not delivered (never trained)"
    )
    if r.ok:
        typer.echo("no drift")
        return
    typer.echo("drift by kind: " + ", ".join(f"{k}={n}" for k, n in r.by_kind().items()))
    for d in r.drifts[:limit]:
        where = f"{d.session_id}" + (f" branch {d.branch}" if d.branch is not None else "")
        typer.echo(f"  [{d.kind}] {where}: {d.detail}")
    if len(r.drifts) > limit:
        typer.echo(f"  ... and {len(r.drifts) - limit} more")
    raise typer.Exit(1)
