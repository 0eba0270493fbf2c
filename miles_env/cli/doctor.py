"""`miles-env doctor [--config FILE]`: check this machine for what a run needs.

One line per check: `ok`, `MISSING` (the config needs it: the command that fixes it follows) or
`-` (not needed by this config, shown with its fix). Exit 1 when something the config needs is
missing, so scripts can gate on it; `scripts/setup.sh` ends with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def doctor_command(
    config: Annotated[
        Path | None, typer.Option("--config", help="run config (YAML/TOML); default: the embedded defaults")
    ] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="override a config key: a.b=value")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the checks as JSON")] = False,
) -> None:
    """Check Python, torch, bubblewrap, cgroups, the model, CLIs, docker, vLLM, adapters, megatron, credentials."""
    from miles_env.config import load_config
    from miles_env.doctor import run_checks
    from miles_env.jsonio import dumps

    checks = run_checks(load_config(config, overrides or []))
    missing = [c for c in checks if c.required and not c.ok]
    if as_json:
        typer.echo(dumps([{**{k: getattr(c, k) for k in c.__slots__}} for c in checks]))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            mark = "ok" if c.ok else ("MISSING" if c.required else "-")
            line = f"{mark:<8}{c.name:<{width + 2}}{c.detail}"
            if not c.ok and c.fix:
                line += f"  -> {c.fix}"
            typer.echo(line)
        typer.echo(
            f"doctor: {len(missing)} missing of what this config needs"
            if missing
            else "doctor: all that this config needs is here"
        )
    if missing:
        raise typer.Exit(1)
