"""`miles-env view RUN_DIR [--port N]`: serve the run viewer (miles_env/view) on loopback.

RUN_DIR is a `miles-env train` run directory, a `miles-env eval --out` directory or a
`miles-env proxy serve --store` directory. Read-only and safe beside a running `train`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["view_command"]


def view_command(
    run_dir: Annotated[Path, typer.Argument(help="run dir, eval --out dir or proxy store")],
    port: Annotated[int, typer.Option(help="TCP port (0: any free port)", min=0, max=65535)] = 8765,
    host: Annotated[str, typer.Option(help="interface to listen on")] = "127.0.0.1",
    model: Annotated[
        str | None, typer.Option(help="tokenizer for display (default: the run's engine.model)")
    ] = None,
) -> None:
    """Serve a local web app over a run: metrics, episodes, conversations, tokens, groups."""
    import socket

    import uvicorn

    from miles_env.http import server_options
    from miles_env.view import create_app, open_run

    run = open_run(run_dir, model)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))  # bound here, so --port 0 names the port it got before serving
    bound = sock.getsockname()[1]
    sock.listen(128)  # connections queue from here on, before uvicorn serves them
    config = uvicorn.Config(
        create_app(run), log_level="warning", access_log=False, lifespan="off", **server_options()
    )
    typer.echo(f"miles-env view: {run.layout.kind.value} at {run.layout.root} on http://{host}:{bound}/")
    uvicorn.Server(config).run(sockets=[sock])
