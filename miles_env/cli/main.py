"""The `miles-env` command line: a thin sync edge over the async core.

Each command group lives in its own module (env, sandbox, eval, proxy, train,
queue, tito, images). Modules keep heavy imports (torch, transformers) inside their
commands so that `miles-env --help` stays fast. Commands raise; edge.py turns a
known error into one line on stderr and exit code 2, once, for all of them.
"""

from __future__ import annotations

import importlib

import typer

from miles_env.cli.edge import EdgeGroup

app = typer.Typer(
    cls=EdgeGroup, no_args_is_help=True, add_completion=False, help="miles-env: agentic RL environment hub."
)

# (module, attribute, name): a group is a typer.Typer added under `name`; a command is a function.
_GROUPS = [
    ("miles_env.cli.env", "app", "env"),
    ("miles_env.cli.sandbox", "app", "sandbox"),
    ("miles_env.cli.proxy", "app", "proxy"),
    ("miles_env.cli.queue", "app", "queue"),
    ("miles_env.cli.tito", "app", "tito"),
    ("miles_env.cli.adapters", "app", "adapters"),
    ("miles_env.cli.images", "app", "images"),
]
_COMMANDS = [
    ("miles_env.cli.eval", "eval_command", "eval"),
    ("miles_env.cli.train", "train_command", "train"),
    ("miles_env.cli.doctor", "doctor_command", "doctor"),
    ("miles_env.cli.view", "view_command", "view"),
]


def _load(module: str) -> object | None:
    """Import a CLI module; a module that is not there (an optional part) is skipped."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return None


def _install() -> None:
    for module, attr, name in _GROUPS:
        if (mod := _load(module)) is not None:
            app.add_typer(getattr(mod, attr), name=name)
    for module, attr, name in _COMMANDS:
        if (mod := _load(module)) is not None:
            app.command(name=name)(getattr(mod, attr))


_install()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
