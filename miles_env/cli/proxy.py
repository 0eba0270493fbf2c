"""`miles-env proxy serve`: run the TITO proxy as a standalone HTTP server.

The engine is built from `--engine` (hf embedded, a sglang server at `--url`, or
the scripted test engine); sessions persist under `--store`, so a restarted
server answers `GET /admin/sessions/{id}/trajectory` for sessions it served
before. The admin token comes from `--admin-token`, else MILES_ENV_ADMIN_TOKEN,
else a random one printed at start.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import anyio
import typer

if TYPE_CHECKING:
    from miles_env.engines.configs import EngineConfig

__all__ = ["app"]

app = typer.Typer(no_args_is_help=True, help="The TITO (token-in-token-out) proxy.")


async def _serve(engine_cfg: EngineConfig, host: str, port: int, store: Path, admin_token: str) -> None:
    import uvicorn

    from miles_env.engines import build_engine
    from miles_env.http import server_options
    from miles_env.models import load_tokenizer
    from miles_env.tito import TitoConfig, TitoProxy, create_app

    engine = await build_engine(engine_cfg)
    try:
        tokenizer = await anyio.to_thread.run_sync(load_tokenizer, engine_cfg.model)
        proxy = TitoProxy(engine, tokenizer, TitoConfig(admin_token=admin_token), store_dir=store)
        config = uvicorn.Config(
            create_app(proxy),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            **server_options(),
        )
        typer.echo(f"TITO proxy on http://{host}:{port} ({engine_cfg.kind} engine, store {store})")
        await uvicorn.Server(config).serve()
    finally:
        await engine.close()


@app.command("serve")
def serve(
    port: Annotated[int, typer.Option(help="TCP port on --host (0: any free port)", min=0, max=65535)],
    store: Annotated[Path, typer.Option(help="directory holding one journal per session")],
    engine: Annotated[str, typer.Option(help="hf | vllm | sglang | scripted")] = "hf",
    model: Annotated[str, typer.Option(help="model name or HF checkpoint path (tokenizer too)")] = "smollm2",
    url: Annotated[str | None, typer.Option(help="vllm/sglang: attach to this server URL")] = None,
    host: Annotated[str, typer.Option(help="interface to listen on")] = "127.0.0.1",
    admin_token: Annotated[
        str | None, typer.Option(help="admin API token (default: env MILES_ENV_ADMIN_TOKEN, else random)")
    ] = None,
    engine_opt: Annotated[
        list[str] | None, typer.Option("--engine-opt", help="engine config key=value (e.g. launch=true)")
    ] = None,
) -> None:
    """Serve the proxy until interrupted."""
    from miles_env.cli.eval import parse_opts
    from miles_env.config import validate_config
    from miles_env.engines import ENGINES
    from miles_env.http import loop_options
    from miles_env.models import resolve_model

    if engine not in ENGINES.names():
        raise typer.BadParameter(f"--engine {engine!r}: choose {', '.join(ENGINES.names())}")
    token = admin_token or os.environ.get("MILES_ENV_ADMIN_TOKEN")
    if not token:
        token = secrets.token_urlsafe(24)
        typer.echo(f"admin token: {token}")
    fields = {
        "kind": engine,
        "model": model,
        **({"url": url} if url else {}),
        **parse_opts(engine_opt, "--engine-opt"),
    }
    engine_cfg = validate_config({"engine": fields}, "the --engine options").engine  # a bad option fails here
    resolve_model(model)  # a wrong --model fails here, before an engine is built or launched
    anyio.run(_serve, engine_cfg, host, port, store, token, backend_options=loop_options())
