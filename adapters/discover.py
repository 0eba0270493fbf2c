"""Discovery of adapter environments for `miles-env env list`, without starting a worker.

Concept: for every installed framework venv (`venv.installed()`), the environments
it can run that can be named by reading files only, never by importing the
framework: our shipped examples (adapters/examples), for verifiers the installed
distributions that depend on verifiers (environment packages, `verifiers:<module>`),
for nemo-gym the resources servers it ships with example data (`nemo-gym:<name>`).
Task counts come from the data file when there is one (nemo-gym), else from a
small cache that each adapter environment's `tasks()` fills when it lists tasks
through its worker (counts.py); an environment never listed shows no count.

A verifiers environment package that cannot load on the installed verifiers is
listed as broken with the reason in one line (`error`), judged from files: its
`Requires-Dist: verifiers<spec>` excludes the installed version, or its module
exports no verifiers.v1 `Taskset` (a `load_environment()` package of the older API).

Invariant: discovery costs file reads only (milliseconds) and never raises for a
broken venv: what cannot be read is left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from miles_env.adapters.counts import cached_counts
from miles_env.adapters.venv import installed, venv_dir

__all__ = ["AdapterEnv", "discover"]

EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"
# Our examples that run as-is (vf_probe.py needs a probe.json written by its test).
EXAMPLES = {
    "verifiers": ("vf_say_word.py",),
    "hud": ("hud_say_word.py",),
    "openenv": ("openenv_guess.py:app",),
}


@dataclass(frozen=True, slots=True)
class AdapterEnv:
    name: str  # loadable by registry.load_environment
    framework: str
    description: str
    n_tasks: dict[str, int] = field(default_factory=dict)  # empty: not counted yet
    error: str | None = None  # why it cannot load here (shown as broken by `env list`)


def _site_packages(framework: str) -> list[Path]:
    return sorted((venv_dir(framework) / "lib").glob("python3*/site-packages"))


def _requirement_name(line: str) -> str | None:
    """`Requires-Dist: verifiers>=0.4; extra == "x"` -> "verifiers"."""
    if not line.startswith("Requires-Dist:"):
        return None
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split(":", 1)[1])
    return re.sub(r"[-_.]+", "-", m.group(1)).lower() if m else None


def _installed_version(site: Path, dist: str) -> str | None:
    for info in site.glob(f"{dist}-*.dist-info"):
        return info.name[len(dist) + 1 : -len(".dist-info")]
    return None


def _version_problem(meta: str, installed_version: str | None) -> str | None:
    """`requires verifiers>=0.5 (installed 0.4.0)` when the package's pin excludes what is installed."""
    from packaging.requirements import InvalidRequirement, Requirement

    for line in meta.splitlines():
        if _requirement_name(line) != "verifiers" or installed_version is None:
            continue
        try:
            req = Requirement(line.split(":", 1)[1].strip())
        except InvalidRequirement:
            return f"unreadable requirement {line.split(':', 1)[1].strip()!r}"
        if req.marker is None and req.specifier and not req.specifier.contains(installed_version, True):
            return f"requires verifiers{req.specifier} (installed {installed_version})"
    return None


def _api_problem(site: Path, module: str) -> str | None:
    """A module with no Taskset in its source cannot be a verifiers.v1 taskset (what the adapter runs)."""
    pkg, single = site / module, site / f"{module}.py"
    files = sorted(pkg.rglob("*.py"))[:50] if pkg.is_dir() else [single] if single.is_file() else []
    if not files:
        return None  # a compiled or namespace module: leave it to load time
    text = "".join(f.read_text(errors="replace") for f in files if f.stat().st_size < 1 << 20)
    if "Taskset" in text:
        return None
    older = (
        " (it defines load_environment(), the older verifiers API)" if "def load_environment" in text else ""
    )
    return f"exports no verifiers.v1 Taskset{older}"


def _verifiers_packages() -> list[tuple[str, str | None]]:
    """(top-level module, why it cannot load or None) of distributions that require verifiers."""
    out: list[tuple[str, str | None]] = []
    for site in _site_packages("verifiers"):
        installed_version = _installed_version(site, "verifiers")
        for dist in sorted(site.glob("*.dist-info")):
            try:
                meta = (dist / "METADATA").read_text(errors="replace")
            except OSError:
                continue
            if not any(_requirement_name(ln) == "verifiers" for ln in meta.splitlines()):
                continue
            top = dist / "top_level.txt"
            names = top.read_text().split() if top.is_file() else [dist.name.split("-", 1)[0]]
            problem = _version_problem(meta, installed_version)
            for n in names:
                if not n.startswith("_"):
                    out.append((n, problem or _api_problem(site, n)))
    return out


def _nemo_gym_servers() -> list[AdapterEnv]:
    out = []
    for site in _site_packages("nemo-gym"):
        for app in sorted(site.glob("resources_servers/*/app.py")):
            data = app.parent / "data" / "example.jsonl"
            if not data.is_file():
                continue
            try:
                n = sum(1 for line in data.read_text(errors="replace").splitlines() if line.strip())
            except OSError:
                continue
            name = app.parent.name
            out.append(
                AdapterEnv(f"nemo-gym:{name}", "nemo-gym", f"NeMo Gym resources server {name}", {"test": n})
            )
    return out


def _openenv_counts(name: str) -> dict[str, int]:
    """OpenEnv tasks are seeds: counted without a worker."""
    from miles_env.adapters.openenv import OpenEnvEnvironment

    env = OpenEnvEnvironment(name.partition(":")[2], name=name)
    return {split: len(env.tasks(split)) for split in env.splits}


def discover() -> list[AdapterEnv]:
    """Every adapter environment nameable from the installed venvs, by framework then name."""
    found: list[AdapterEnv] = []
    for info in installed():
        fw = info.name
        for example in EXAMPLES.get(fw, ()):
            name = f"{fw}:{EXAMPLES_DIR / example}"
            counts = _openenv_counts(name) if fw == "openenv" else cached_counts(name)
            found.append(AdapterEnv(name, fw, f"{fw} example {example}", counts))
        if fw == "verifiers":
            for module, problem in _verifiers_packages():
                name = f"verifiers:{module}"
                desc = f"verifiers environment package {module}"
                found.append(AdapterEnv(name, fw, desc, cached_counts(name), problem))
        elif fw == "nemo-gym":
            found += _nemo_gym_servers()
    return found
