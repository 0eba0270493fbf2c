"""`miles-env sandbox`: debug and maintenance commands for sandbox providers.

`miles-env sandbox exec [--sandbox P] [--image I] [--timeout S] [--file host:inner] -- CMD...`
runs one command in a fresh sandbox of provider P (default local), prints its
stdout and stderr, and exits with its exit code (128+N when killed by signal N,
124 on timeout).
`miles-env sandbox gc [--provider P] [--ttl S]` removes sandboxes left behind by
crashed runs (owner process dead, or older than the TTL) and prints what it removed.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="Run commands in a sandbox (debugging); remove orphans (gc).")

PROVIDERS = ("local", "docker", "e2b", "daytona", "modal", "agentenv")


def _parse_files(pairs: list[str]) -> dict[str, str]:
    files: dict[str, str] = {}
    for pair in pairs:
        host, sep, inner = pair.partition(":")
        if not sep or not host or not inner:
            raise typer.BadParameter(f"--file {pair!r}: expected HOST_PATH:INNER_PATH")
        try:
            with open(host) as f:
                files[inner] = f.read()
        except OSError as e:
            raise typer.BadParameter(f"--file {pair!r}: cannot read {host}: {e.strerror}") from e
    return files


@app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_command(
    cmd: Annotated[list[str], typer.Argument(help="the command and its arguments (after --)")],
    timeout: Annotated[float, typer.Option(help="wall-clock limit in seconds")] = 60.0,
    file: Annotated[
        list[str] | None, typer.Option("--file", help="HOST:INNER file to place (repeatable)")
    ] = None,
    sandbox: Annotated[str, typer.Option("--sandbox", "--provider", help="|".join(PROVIDERS))] = "local",
    image: Annotated[str | None, typer.Option(help="container image (docker and cloud providers)")] = None,
) -> None:
    """Run CMD in a fresh sandbox and exit with its exit code."""
    import anyio

    from miles_env.sandboxes import get_provider
    from miles_env.types import SandboxSpec

    spec = SandboxSpec(files=_parse_files(file or []), image=image)

    async def run() -> int:
        async with await get_provider(sandbox).create(spec) as sb:
            argv: str | list[str] = cmd[0] if len(cmd) == 1 else cmd
            result = await sb.exec(argv, timeout=timeout)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.timed_out:
            sys.stderr.write(f"[sandbox] timed out after {timeout}s\n")
            return 124
        if result.killed_by_limit or result.truncated:
            sys.stderr.write(f"[sandbox] limit={result.killed_by_limit} truncated={result.truncated}\n")
        return 128 - result.exit_code if result.exit_code < 0 else result.exit_code

    raise typer.Exit(anyio.run(run))


@app.command("gc")
def gc_command(
    provider: Annotated[str, typer.Option("--provider", "--sandbox", help="|".join(PROVIDERS))] = "local",
    ttl: Annotated[
        float | None,
        typer.Option(help="remove sandboxes older than this many seconds (default: each one's own TTL)"),
    ] = None,
) -> None:
    """Remove sandboxes whose owner process died or whose TTL passed."""
    import anyio

    from miles_env.sandboxes.pool import reap

    removed = anyio.run(lambda: reap(provider, ttl_s=ttl))
    for name in removed:
        typer.echo(name)
    typer.echo(f"removed {len(removed)} sandbox(es) of provider {provider!r}")
