"""`miles-env env ...`: list, inspect, scaffold and oracle-check environments.

A thin sync edge over miles_env.registry and miles_env.oracle. Errors from the
registry (unknown name, bad task) print one clear line and exit 2; `eval --oracle`
exits 1 unless every reference solution passes.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from importlib.resources import files as resource_files
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from miles_env.errors import MilesEnvError
from miles_env.jsonio import dumps

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="List, inspect, scaffold and check environments."
)


# Made per print, so the width is the terminal's (or COLUMNS) of now, not of whenever this module
# was first imported. emoji=False: ":x:" in "module:x" must not become an emoji.
def _out() -> Console:
    return Console(emoji=False)


def _err() -> Console:
    return Console(stderr=True, emoji=False, soft_wrap=True)  # an error stays one line, whatever the width


_NAME_RE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


def _fail(err: Exception, code: int = 2) -> typer.Exit:
    _err().print(f"[red]error:[/red] {escape(str(err))}", highlight=False)
    return typer.Exit(code)


def _load(name: str) -> Any:
    from miles_env.registry import load_environment

    try:
        return load_environment(name)
    except MilesEnvError as e:
        raise _fail(e) from None


@app.command("list")
def list_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
    module: Annotated[list[str], typer.Option("--module", "-m", help="Also list a 'module.path:attr'.")] = [],  # noqa: B006
    adapters: Annotated[
        bool, typer.Option("--adapters/--no-adapters", help="List installed adapter venvs' environments.")
    ] = True,
) -> None:
    """Installed environments: name, source and number of tasks per split."""
    from miles_env.registry import list_environments

    infos = list_environments(module, adapters=adapters)
    if as_json:
        print(dumps([i.to_dict() for i in infos], indent=2))
        return
    table = Table(title="miles-env environments")
    for col in ("name", "source", "tasks"):
        table.add_column(col)
    for i in infos:
        counts = ", ".join(f"{s}: {n}" for s, n in i.n_tasks.items())
        if not counts and i.source.startswith("adapter:"):
            counts = "[dim]not counted yet (env info NAME)[/dim]"
        table.add_row(i.name, i.source, "[red]failed to load[/red]" if i.error else counts)
    _out().print(table)
    for i in infos:
        if i.error:
            _err().print(f"[red]{escape(i.name)}:[/red] {escape(i.error)}", highlight=False)


def _info_dict(env: Any, n_examples: int) -> dict[str, Any]:
    splits: dict[str, Any] = {}
    for split in env.splits:
        tasks = env.tasks(split)
        tiers = Counter(str(t.metadata["tier"]) for t in tasks if "tier" in t.metadata)
        splits[split] = {
            "n_tasks": len(tasks),
            "tiers": dict(sorted(tiers.items())),
            "examples": [{"id": t.id, "instruction": t.instruction} for t in tasks[:n_examples]],
        }
    return {"name": env.name, "description": env.description, "splits": splits}


@app.command("info")
def info_command(
    name: Annotated[str, typer.Argument(help="Environment name or 'module.path:attr'.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    examples: Annotated[int, typer.Option(help="Example tasks to show per split.")] = 3,
) -> None:
    """Description, splits, task counts (per tier when tasks have one) and example tasks."""
    info = _info_dict(_load(name), examples)
    if as_json:
        print(dumps(info, indent=2))
        return
    _out().print(f"[bold]{info['name']}[/bold]: {info['description']}")
    for split, s in info["splits"].items():
        tiers = ", ".join(f"tier {k}: {v}" for k, v in s["tiers"].items())
        _out().print(f"\n[bold]{split}[/bold]: {s['n_tasks']} tasks" + (f" ({tiers})" if tiers else ""))
        for ex in s["examples"]:
            _out().print(f"  [cyan]{escape(ex['id'])}[/cyan]  {escape(ex['instruction'])}", highlight=False)


def scaffold(name: str, target: Path) -> list[Path]:
    """Write a new environment package for `name` into `target`; return the files written."""
    if not _NAME_RE.match(name):
        raise typer.BadParameter(
            f"{name!r}: use lowercase letters, digits and single dashes", param_hint="NAME"
        )
    if target.exists() and any(target.iterdir()):
        raise typer.BadParameter(f"{target} exists and is not empty", param_hint="--dir")
    package = "miles_env_" + name.replace("-", "_")
    values = {
        "name": name,
        "package": package,
        "dist_name": f"miles-env-{name}",
        "class_name": "".join(p.capitalize() for p in name.split("-")) + "Env",
    }
    src = resource_files("miles_env") / "templates" / "env"
    layout = {
        "pyproject.toml.tmpl": "pyproject.toml",
        "README.md.tmpl": "README.md",
        "module.py.tmpl": f"{package}/__init__.py",
    }
    written = []
    for tmpl, rel in layout.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(string.Template((src / tmpl).read_text()).substitute(values))
        written.append(path)
    return written


@app.command("init")
def init_command(
    name: Annotated[str, typer.Argument(help="Name of the new environment, e.g. my-tasks.")],
    dir: Annotated[
        Path | None, typer.Option("--dir", help="Where to create the package (default ./NAME).")
    ] = None,
) -> None:
    """Scaffold a new environment package (pyproject with the entry point, module, README)."""
    target = dir if dir is not None else Path(name)
    for path in scaffold(name, target):
        _out().print(f"created {path}", highlight=False)
    _out().print(f"\nnext: pip install -e {target} && miles-env env list", highlight=False)


def _first_reason(result: Any) -> str:
    if result.error:
        return result.error
    for row in result.details.get("checks", []):
        if not row["passed"]:
            return f"{row['kind']} {row['target']}: {row['reason']}"
    return f"score {result.score}"


def _print_report(report: Any) -> None:
    by_group: dict[tuple[str, str], list[bool]] = {}
    for r in report.results:
        by_group.setdefault((r.split, "" if r.tier is None else str(r.tier)), []).append(r.passed)
    table = Table(title=f"oracle: {report.env}")
    for col in ("split", "tier", "passed", "total"):
        table.add_column(col)
    for (split, tier), oks in sorted(by_group.items()):
        table.add_row(split, tier or "-", str(sum(oks)), str(len(oks)))
    _out().print(table)
    for r in report.failures:
        why = "" if r.end.value == "completed" else " " + escape(f"[{r.end.value}]")  # infrastructure
        _out().print(f"[red]FAIL[/red]{why} {escape(r.task_id)}: {escape(_first_reason(r))}", highlight=False)
    for r in report.results:  # reward-hacking flags the guards raised on the solution (miles_env/guards)
        if r.flags:
            _out().print(
                f"[yellow]FLAG[/yellow] {escape(r.task_id)}: {escape(', '.join(r.flags))}", highlight=False
            )
    colour = "green" if not report.failures else "red"
    ends = ", ".join(f"{k} {n}" for k, n in report.ends().items())
    _out().print(
        f"[{colour}]pass rate {report.pass_rate:.1%}[/{colour}] ({report.n_passed}/{report.n_total}) "
        f"in {report.duration_s:.1f}s; ends: {ends}"
    )


@app.command("eval")
def eval_command(
    name: Annotated[str, typer.Argument(help="Environment name or 'module.path:attr'.")],
    oracle: Annotated[bool, typer.Option("--oracle", help="Run each task's reference solution.")] = False,
    split: Annotated[str | None, typer.Option(help="Only this split (default: all).")] = None,
    task: Annotated[list[str], typer.Option("--task", help="Only these task ids.")] = [],  # noqa: B006
    concurrency: Annotated[int, typer.Option(min=1, help="Sandboxes at once.")] = 4,
    provider: Annotated[str, typer.Option(help="Sandbox provider.")] = "local",
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check an environment end to end: reference solutions in real sandboxes, then verify()."""
    if not oracle:
        raise _fail(ValueError("env eval needs --oracle (to evaluate a model use `miles-env eval`)"))
    import anyio

    from miles_env.oracle import run_oracle
    from miles_env.sandboxes import get_provider

    env = _load(name)
    if split is not None and split not in env.splits:
        raise _fail(ValueError(f"--split {split!r}: environment {env.name!r} has splits {list(env.splits)}"))
    tasks = env.tasks(split)
    if task:
        unknown = sorted(set(task) - {t.id for t in tasks})
        if unknown:
            raise _fail(ValueError(f"--task: unknown task ids {unknown}"))
        tasks = [t for t in tasks if t.id in set(task)]
    try:
        prov = get_provider(provider)
    except MilesEnvError as e:
        raise _fail(e) from None
    report = anyio.run(run_oracle, env, tasks, prov, concurrency)
    if as_json:
        print(dumps(report.to_dict(), indent=2))
    else:
        _print_report(report)
    if report.failures or not report.results:
        raise typer.Exit(1)


@app.command("validate")
def validate_command(
    name: Annotated[
        str, typer.Argument(help="Environment name, 'module.path:attr', 'harbor:/path' or a task dir.")
    ],
    quick: Annotated[bool, typer.Option("--quick", help="Skip only the 2-step GRPO run.")] = False,
    provider: Annotated[str, typer.Option(help="Sandbox provider: local or docker.")] = "local",
    report: Annotated[
        Path | None, typer.Option("--report", help="Also write the report as JSON here.")
    ] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Sandboxes at once.")] = 4,
    network: Annotated[
        str | None,
        typer.Option(help="'none' forbids the network to every task (as rollout.limits.network does)."),
    ] = None,
) -> None:
    """The registration gate: schema, oracle = 1, do-nothing = 0, verifier determinism, 2-step GRPO."""
    from miles_env.jsonio import write_json
    from miles_env.validate import validate_env

    result = validate_env(name, provider=provider, quick=quick, concurrency=concurrency, network=network)
    print(result.render())
    if report is not None:
        write_json(report, result.to_dict())
    if not result.passed:
        raise typer.Exit(1)
