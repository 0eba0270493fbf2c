"""Per-framework virtual environments: find a suitable Python, create the venv, install the pin.

Concept: every framework adapter runs its package in its own venv, because their
requirements conflict (verifiers needs mcp 2, hud and openenv need mcp < 2; harbor
and nemo-gym need Python >= 3.12, hud < 3.13). A `FrameworkSpec` says which
package, at which pinned version, under which Python range.

Invariant: a venv counts as installed only when its marker file
`miles-env-adapter.json` exists; the marker is written last, after the install
succeeded, so an interrupted install is redone, never half-used.

Lifecycle: `install(spec)` is idempotent (a present marker with the same pin and
lock is a no-op unless `force`); venvs live under `cache_root()/NAME`.

Locks: the pin names only the framework; its dependencies are held by
`adapters/locks/NAME.txt` (pip freeze of a fresh resolution, made by
`scripts/lock.sh NAME`), passed to the installer as constraints, so an upstream
release cannot change what a fresh machine installs. The lock's digest is in the
marker: a changed lock reinstalls. `MILES_ENV_LOCK=none` resolves freely (re-locking).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_env.errors import ConfigError, MilesEnvError, RegistryError

__all__ = [
    "FrameworkSpec",
    "FRAMEWORKS",
    "AdapterInstallError",
    "NoSuitablePython",
    "VenvInfo",
    "cache_root",
    "find_python",
    "install",
    "installed",
    "venv_python",
]

MARKER = "miles-env-adapter.json"


class AdapterInstallError(MilesEnvError):
    """Creating a framework venv or installing its package failed."""


class NoSuitablePython(AdapterInstallError):
    """No interpreter on this machine satisfies the framework's Python range."""


@dataclass(frozen=True, slots=True)
class FrameworkSpec:
    name: str
    packages: tuple[str, ...]  # pip requirement strings, pinned
    min_python: tuple[int, int] = (3, 11)
    max_python: tuple[int, int] | None = None  # exclusive upper bound (3, 13) means < 3.13
    import_name: str = ""  # module imported to check the install
    env: dict[str, str] = field(default_factory=dict)  # environment for the worker process


FRAMEWORKS: dict[str, FrameworkSpec] = {
    "verifiers": FrameworkSpec("verifiers", ("verifiers==0.4.0",), import_name="verifiers"),
    "openenv": FrameworkSpec(
        "openenv",
        ("openenv-core==0.3.0", "websockets"),
        import_name="openenv",
        env={"ENABLE_WEB_INTERFACE": "false"},
    ),
    "hud": FrameworkSpec(
        "hud",
        ("hud==0.6.21",),
        max_python=(3, 13),
        import_name="hud",
        env={"HUD_TELEMETRY_ENABLED": "false"},
    ),
    "nemo-gym": FrameworkSpec("nemo-gym", ("nemo-gym==0.4.0",), min_python=(3, 12), import_name="nemo_gym"),
    "harbor": FrameworkSpec(
        "harbor",
        ("harbor==0.26.0",),
        min_python=(3, 12),
        import_name="harbor",
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    ),
}


def get_spec(name: str) -> FrameworkSpec:
    spec = FRAMEWORKS.get(name)
    if spec is None:
        raise ConfigError(f"adapter {name!r} is unknown; known adapters: {', '.join(sorted(FRAMEWORKS))}")
    return spec


def cache_root() -> Path:
    """MILES_ENV_CACHE/adapters, else ~/.cache/miles-env/adapters."""
    base = os.environ.get("MILES_ENV_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "miles-env"
    return root / "adapters"


def venv_dir(name: str) -> Path:
    return cache_root() / name


def venv_python(name: str) -> Path:
    return venv_dir(name) / "bin" / "python"


def _version_of(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = out.stdout.split()
    if out.returncode != 0 or len(parts) != 2:
        return None
    return int(parts[0]), int(parts[1])


def _candidates() -> list[str]:
    """Interpreters found generically: this one, PATH, pyenv versions, `uv python find`."""
    found: list[str] = [sys.executable]
    for minor in range(11, 16):
        exe = shutil.which(f"python3.{minor}")
        if exe:
            found.append(exe)
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if pyenv_root.is_dir():
        for d in sorted(pyenv_root.iterdir(), reverse=True):
            found += [str(p) for p in sorted((d / "bin").glob("python3.*")) if p.name.count(".") == 1]
    uv = _uv()
    if uv:
        for minor in range(11, 16):
            r = subprocess.run([uv, "python", "find", f"3.{minor}"], capture_output=True, text=True)
            if r.returncode == 0 and r.stdout.strip():
                found.append(r.stdout.strip())
    return list(dict.fromkeys(found))


def find_python(spec: FrameworkSpec) -> tuple[str, tuple[int, int]]:
    """The newest interpreter inside the spec's range, or NoSuitablePython listing what was seen."""
    seen: list[str] = []
    best: tuple[str, tuple[int, int]] | None = None
    for exe in _candidates():
        ver = _version_of(exe)
        if ver is None:
            continue
        seen.append(f"{exe} ({ver[0]}.{ver[1]})")
        ok = ver >= spec.min_python and (spec.max_python is None or ver < spec.max_python)
        if ok and (best is None or ver > best[1]):
            best = (exe, ver)
    if best is None:
        want = f">= {spec.min_python[0]}.{spec.min_python[1]}"
        if spec.max_python:
            want += f", < {spec.max_python[0]}.{spec.max_python[1]}"
        raise NoSuitablePython(
            f"adapter {spec.name!r} needs Python {want}; found: {', '.join(seen) or 'none'}. "
            "Install one (pyenv install, uv python install) and put it on PATH."
        )
    return best


@dataclass(frozen=True, slots=True)
class VenvInfo:
    name: str
    path: str
    python: str
    python_version: str
    packages: tuple[str, ...]
    installed_at: float
    seconds: float = 0.0
    lock: str = ""  # sha256 of the constraints file installed with, "" when none
    reused: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def lock_file(name: str) -> Path | None:
    """NAME's constraints file, or None (no lock shipped, or MILES_ENV_LOCK=none)."""
    path = Path(__file__).parent / "locks" / f"{name}.txt"
    if os.environ.get("MILES_ENV_LOCK") == "none" or not path.is_file():
        return None
    return path


def _read_marker(name: str) -> VenvInfo | None:
    path = venv_dir(name) / MARKER
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        data["packages"] = tuple(data["packages"])
        data["reused"] = True
        return VenvInfo(**data)
    except (ValueError, TypeError, KeyError):
        return None


def _run(cmd: list[str], what: str, timeout: float) -> None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AdapterInstallError(f"{what}: timed out after {timeout:.0f}s") from e
    if r.returncode != 0:
        tail = (r.stdout + r.stderr)[-3000:]
        raise AdapterInstallError(f"{what}: exit {r.returncode}\n{tail}")


def _uv() -> str | None:
    """uv from the `uv` package beside this interpreter (requirements.lock), else on PATH."""
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def _create(
    python: str, target: Path, constraints: tuple[str, ...], packages: tuple[str, ...], timeout: float
) -> None:
    """The venv at `target` with `packages` installed under `constraints`: by uv (measured 5x pip's
    speed: openenv 10 s vs 54 s), else by pip; byte-compiled as pip does (with
    PYTHONDONTWRITEBYTECODE=1, or in a read-only sandbox, no import writes one). uv reads its own index settings (UV_INDEX_URL...),
    not pip's config: where uv cannot install what pip can (a pip-only mirror), pip does it, and a
    warning says why."""
    vpy = str(target / "bin" / "python")
    uv = _uv()
    if uv:
        try:
            _run([uv, "venv", "--python", python, str(target)], f"uv venv {target}", 300)
            _run(
                [uv, "pip", "install", "--python", vpy, "--compile-bytecode", *constraints, *packages],
                f"uv pip install {packages}",
                timeout,
            )
            return
        except AdapterInstallError as e:
            print(f"warning: {str(e).splitlines()[0]}; installing with pip instead", file=sys.stderr)
            shutil.rmtree(target, ignore_errors=True)
    _run([python, "-m", "venv", str(target)], f"{python} -m venv {target}", 300)
    _run(
        [vpy, "-m", "pip", "install", "-q", *constraints, *packages],
        f"pip install {' '.join(packages)}",
        timeout,
    )


def install(
    name: str, *, force: bool = False, extra: tuple[str, ...] = (), timeout: float = 1800.0
) -> VenvInfo:
    """Create NAME's venv and install its pinned packages (plus `extra`); idempotent."""
    spec = get_spec(name)
    packages = spec.packages + tuple(extra)
    lock = lock_file(name)
    digest = hashlib.sha256(lock.read_bytes()).hexdigest() if lock else ""
    constraints = ("-c", str(lock)) if lock else ()
    current = _read_marker(name)
    if (
        current is not None
        and not force
        and set(packages) <= set(current.packages)
        and current.lock == digest
    ):
        return current
    python, ver = find_python(spec)
    target = venv_dir(name)
    t0 = time.perf_counter()
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _create(python, target, constraints, packages, timeout)
    if spec.import_name:
        _run(
            [str(target / "bin" / "python"), "-c", f"import {spec.import_name}"],
            f"import {spec.import_name} in {target}",
            300,
        )
    info = VenvInfo(
        name=name,
        path=str(target),
        python=python,
        python_version=f"{ver[0]}.{ver[1]}",
        packages=packages,
        installed_at=time.time(),
        seconds=round(time.perf_counter() - t0, 1),
        lock=digest,
    )
    data = info.to_dict()
    data.pop("reused")
    (target / MARKER).write_text(json.dumps(data, indent=2))
    return info


def installed() -> list[VenvInfo]:
    """Every framework venv with a marker, in FRAMEWORKS order."""
    return [info for name in FRAMEWORKS if (info := _read_marker(name)) is not None]


def worker_rows(adapter: str, env_name: str, script: str, *args: str) -> list[dict[str, Any]]:
    """One `tasks` call to a one-shot worker in `adapter`'s venv (its listing of an environment)."""
    from miles_env.adapters.worker_client import WorkerError, call_once, python_argv

    python = venv_python(adapter)
    if not python.exists():
        raise RegistryError(f"{env_name}: run `miles-env adapters install {adapter}` first")
    try:
        rows: list[dict[str, Any]] = call_once(
            python_argv(python, script, *args), "tasks", {}, env=get_spec(adapter).env
        )
    except WorkerError as e:  # a bad reference: say which environment it was
        raise WorkerError(f"{env_name}: {e}") from None
    return rows
