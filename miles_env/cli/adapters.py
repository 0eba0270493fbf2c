"""`miles-env adapters install|list`: the per-framework virtual environments."""

from __future__ import annotations

from typing import Annotated

import typer

from miles_env.jsonio import dumps

app = typer.Typer(
    no_args_is_help=True, help="Framework adapters (harbor, hud, nemo-gym, openenv, verifiers)."
)


@app.command("install")
def install_command(
    name: Annotated[str, typer.Argument(help="harbor | hud | nemo-gym | openenv | verifiers")],
    force: Annotated[bool, typer.Option(help="recreate the venv even if it is installed")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Create NAME's venv with a suitable Python and install its pinned package."""
    from miles_env.adapters.venv import install

    info = install(name, force=force)
    if as_json:
        typer.echo(dumps(info.to_dict()))
        return
    what = "already installed" if info.reused else f"installed in {info.seconds:.0f}s"
    typer.echo(
        f"{name}: {what}: {', '.join(info.packages)} with Python {info.python_version} ({info.python})"
    )
    typer.echo(f"venv: {info.path}")


@app.command("list")
def list_command(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Installed framework venvs (and the ones that are not)."""
    from pathlib import Path

    import miles_env.adapters as pkg
    from miles_env.adapters.venv import FRAMEWORKS, cache_root, installed

    ex = Path(pkg.__file__).parent / "examples"
    examples = {
        "harbor": f"harbor:{ex / 'harbor_tasks'} --harness framework --harness-opt agent=terminus-2"
        "   (or any --harness natively: no install needed)",
        "hud": f"hud:{ex / 'hud_say_word.py'} --harness framework",
        "nemo-gym": "nemo-gym:mcqa --harness framework",
        "openenv": f"openenv:{ex / 'openenv_guess.py'}:app --harness framework",
        "verifiers": f"verifiers:{ex / 'vf_say_word.py'} --harness framework",
    }
    infos = {i.name: i for i in installed()}
    if as_json:
        typer.echo(dumps([i.to_dict() for i in infos.values()]))
        return
    typer.echo(f"cache: {cache_root()}")
    for name, spec in FRAMEWORKS.items():
        i = infos.get(name)
        state = f"installed ({', '.join(i.packages)}, Python {i.python_version})" if i else "not installed"
        typer.echo(f"{name:10s} {state}   pin: {', '.join(spec.packages)}")
        typer.echo(f"{'':10s} e.g. miles-env eval --env {examples[name]}")
