"""The verifier's Python: a CPython for `uvx -p 3.X` where the image's own apt has none, from a distribution's packages.

Concept: the stock Terminal-Bench 2 verifier runs `uvx -p 3.13 ...`. On Harbor, uv downloads a
CPython 3.13 (python-build-standalone, from GitHub) at each verify; offline it may not
(UV_PYTHON_DOWNLOADS=never), so hermetic.py provides one at build time. First the image's own
apt (`python3.13` on Debian trixie); where that has none (Ubuntu noble has 3.12 only), the
packages of the distribution that builds it (3.13: Debian trixie's; 3.12: Ubuntu noble's; 3.11:
Debian bookworm's), downloaded on the host by apt (which verifies them against the archive's
signed index, as any apt download) and put into the build context. In the image, `install.sh`
unpacks them as a uv-managed installation (`cpython-3.13.5-linux-x86_64-gnu`, with
`bin/` and `lib/`: CPython finds its library relative to its binary) in
`~/.local/share/uv/python`, the directory where uv would have put its own download (root's, and
the final USER's as a hard-linked copy whose files stay root's: uv skips symlinked entries), so
uv finds it as a managed Python, and nothing in the image's /usr changes. It installs the shared libraries
those packages need from the image's apt (Ubuntu's and Debian's share the names, with or without
the `t64` suffix); `ssl` may not import where the image's OpenSSL is older than the packages'
(uv and pytest do not need it).

Invariant: a package's binaries need the glibc they were built against; install.sh refuses, with
the two versions in its line, an image whose glibc is older (bookworm's 2.36 for 3.13: that task
then needs a registry that has the real image, or a mirror of python-build-standalone).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from miles_env.sandboxes.images.suites import SUITES

__all__ = ["ForeignPython", "FOREIGN_PYTHONS", "INSTALL_SH", "python_debs"]


@dataclass(frozen=True, slots=True)
class ForeignPython:
    minor: str  # "3.13"
    suite: str  # the suite whose packages build it (suites.py)
    glibc: str  # the oldest glibc its binaries run on (its packages' libc6 Pre-Depends)

    @property
    def packages(self) -> tuple[str, ...]:
        v = self.minor
        return (f"python{v}-minimal", f"libpython{v}-minimal", f"libpython{v}-stdlib", f"python{v}")


FOREIGN_PYTHONS = {
    p.minor: p
    for p in (
        ForeignPython("3.13", "trixie", "2.38"),
        ForeignPython("3.12", "noble", "2.38"),
        ForeignPython("3.11", "bookworm", "2.34"),
    )
}
# The shared libraries the four packages link (their Depends), by Debian's and Ubuntu's names
# (install.sh drops a `t64` the image's apt does not know)
_RUNTIME = (
    "libexpat1 zlib1g libffi8 libsqlite3-0 libbz2-1.0 liblzma5 libncursesw6 libreadline8t64 libtinfo6 "
    "libuuid1 libdb5.3t64 libmpdec3 tzdata media-types netbase ca-certificates"
)
_ARCH = {"x86_64": ("amd64", "x86_64"), "aarch64": ("arm64", "aarch64"), "arm64": ("arm64", "aarch64")}


def _apt_download(suite_name: str, packages: tuple[str, ...], dest: Path) -> None:
    """Download `packages` of `suite_name` (with its updates and security) into dest with the host's apt,
    in a private state directory: the host's own sources and lists are not touched."""
    suite = SUITES[suite_name]
    with tempfile.TemporaryDirectory(prefix="miles-apt-") as tmp:
        root = Path(tmp)
        (root / "lists" / "partial").mkdir(parents=True)
        signed = f"[signed-by={suite.keyring}] " if suite.keyring else ""
        sources = [line.replace("deb ", f"deb {signed}", 1) for line in suite.sources()]
        (root / "sources.list").write_text("\n".join(sources) + "\n")
        os.chmod(root, 0o755)
        opts = [
            "-o", f"Dir::Etc::SourceList={root / 'sources.list'}",
            "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", f"Dir::State::Lists={root / 'lists'}",
            "-o", "APT::Sandbox::User=root",
        ]  # fmt: skip
        for argv, cwd in (
            (["apt-get", "-qq", *opts, "update"], None),
            (["apt-get", "-qq", *opts, "download", *packages], dest),
        ):
            proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(argv[:2])} {argv[-1]}: {proc.stderr.strip()[-300:]}")


def python_debs(minor: str, cache: Path) -> tuple[Path, str] | None:
    """(a folder of the packages that make CPython `minor`, its full version "3.13.5"), downloaded
    once into `cache`; None when no distribution here builds that minor or the host cannot
    download (no apt, no archive): the provisioning log then says the Python is missing."""
    foreign = FOREIGN_PYTHONS.get(minor)
    if foreign is None or shutil.which("apt-get") is None:
        return None
    arch = _ARCH.get(platform.machine())
    if arch is None:
        return None
    out = cache / "pythons" / f"{minor}-{foreign.suite}-{arch[0]}"
    debs = sorted(out.glob("*.deb")) if out.is_dir() else []
    if len(debs) != len(foreign.packages):
        tmp = Path(tempfile.mkdtemp(prefix="pythons-", dir=_mkdir(cache / "pythons")))
        try:
            _apt_download(foreign.suite, foreign.packages, tmp)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        except (OSError, RuntimeError, subprocess.TimeoutExpired):
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        debs = sorted(out.glob("*.deb"))
    m = re.match(
        rf"python{re.escape(minor)}-minimal_(\d+\.\d+\.\d+)",
        next((d.name for d in debs if "-minimal_" in d.name and d.name.startswith("python")), ""),
    )
    return (out, m.group(1)) if m else None


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


# install.sh MINOR VERSION GLIBC DEBS_DIR USER: run as root by provision.sh at build time
INSTALL_SH = f"""#!/bin/sh
# miles-env hermetic verification: CPython $1 from a distribution's packages, as a uv-managed Python
set -e
minor=$1 version=$2 need=$3 debs=$4 user=$5
have=$(getconf GNU_LIBC_VERSION 2>/dev/null | cut -d' ' -f2)
older=$(printf '%s\\n%s\\n' "$need" "${{have:-0}}" | sort -V | head -n1)
if [ "$older" != "$need" ]; then
    echo "python$minor from $debs needs glibc >= $need; this image has ${{have:-none}}" >&2
    exit 3
fi
arch=$(uname -m)
apt-cache show libc6 >/dev/null 2>&1 || apt-get update -qq
pkgs=""
for p in {_RUNTIME}; do
    if apt-cache show "$p" >/dev/null 2>&1; then pkgs="$pkgs $p"
    elif apt-cache show "${{p%t64}}" >/dev/null 2>&1; then pkgs="$pkgs ${{p%t64}}"; fi
done
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs
dir=/root/.local/share/uv/python/cpython-$version-linux-$arch-gnu
tmp=$(mktemp -d)
for d in "$debs"/*.deb; do dpkg-deb -x "$d" "$tmp"; done
mkdir -p "$dir" && mv "$tmp/usr/bin" "$tmp/usr/lib" "$dir/" && rm -rf "$tmp"
ln -sf "python$minor" "$dir/bin/python3" && ln -sf "python$minor" "$dir/bin/python"
"$dir/bin/python$minor" -c "import sys; assert sys.prefix == '$dir', sys.prefix"
home=$(getent passwd "$user" | cut -d: -f6)
if [ -n "$user" ] && [ -n "$home" ]; then
    # the final USER's own managed directory: a linked copy, its files root's and read-only to it
    mkdir -p "$home/.local/share/uv/python" && cp -al "$dir" "$home/.local/share/uv/python/"
    for d in .local .local/share .local/share/uv .local/share/uv/python; do chown "$user" "$home/$d"; done
fi
"""
