"""`miles-env train CONFIG [--set key=value ...]`: the main job."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import anyio
import typer

__all__ = ["train_command"]


def train_command(
    config: Annotated[Path, typer.Argument(help="run config (YAML or TOML)")],
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="override a config key, e.g. --set trainer.steps=4")
    ] = None,
) -> None:
    """Agentic RL: rollouts through the TITO proxy into the replay queue, GRPO training, weight sync."""
    from rich.console import Console

    from miles_env.config import load_config
    from miles_env.http import loop_options
    from miles_env.job.run import run_training

    console = Console()
    cfg = load_config(config, overrides or [])
    summary = anyio.run(run_training, cfg, console, backend_options=loop_options())  # the proxy on uvloop
    if "rank" in summary:  # a torchrun follower (trainer/ranks.py)
        console.print(f"rank {summary['rank']}: made {summary['trainer_calls']} trainer calls with rank 0")
        return
    console.print(f"[green]done[/] {summary['steps']} steps; run directory {summary['run_dir']}")
