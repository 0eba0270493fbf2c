"""The built-in alias table: common base images, substituted by Debian builds when they cannot be had.

Concept: a machine that reaches no image registry (air-gapped, or ours: only PyPI, Debian and
npm) can still build most tasks, because most bases are "a Debian-like system plus a toolchain".
Each entry maps references (a regular expression over the familiar name: `ubuntu:24.04`,
`python:3.12-slim-bookworm`, `golang:1.22-bookworm`, also reached through ECR Public's copy of the
official images) to a recipe: a bootstrapped Debian suite plus Debian packages and a few steps
that put things where the original image has them (`python` on PATH, Go in /usr/local/go,
JAVA_HOME). The Debian release is chosen for the toolchain's version, not the name's distro.

Invariant: used only after every registry (mirrors, the image's own) failed; never for a
digest-pinned reference; every use is printed and recorded (`ResolvedImage.substituted_from`).
What a substitute is not: the same bytes. Versions differ (Debian's Python 3.13 for python:3.12,
Go 1.24 for golang:1.22, GCC 14 for gcc:13); `note` says which.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .refs import HUB, ImageRef

__all__ = ["Alias", "ALIASES", "find_alias", "DEBIAN_SUITES"]

DEBIAN_SUITES = ("bookworm", "trixie")
_APT = (
    "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {pkgs} "
    "&& rm -rf /var/lib/apt/lists/*"
)
_PY_LINKS = (
    "rm -f /usr/lib/python3*/EXTERNALLY-MANAGED && ln -sf /usr/bin/python3 /usr/local/bin/python "
    "&& ln -sf /usr/bin/python3 /usr/local/bin/python3 && ln -sf /usr/bin/pip3 /usr/local/bin/pip "
    "&& ln -sf /usr/bin/pip3 /usr/local/bin/pip3"
)
_GO = "ln -s /usr/lib/go /usr/local/go && mkdir -p /go/src /go/bin && chmod -R 1777 /go"
_JAVA = 'ln -s "$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")" /opt/java/openjdk'
_JAVA_DIR = "mkdir -p /opt/java && " + _JAVA
_BUILD = ("build-essential", "git", "curl", "wget", "ca-certificates")


@dataclass(frozen=True, slots=True)
class Alias:
    pattern: str  # fullmatch on the familiar name (Docker Hub's `library/` dropped)
    suite: str  # the bootstrapped Debian base it builds on
    packages: tuple[str, ...] = ()
    steps: tuple[str, ...] = ()  # shell steps after the install
    env: tuple[tuple[str, str], ...] = ()
    workdir: str | None = None
    note: str = ""  # what differs from the original, for the message

    def recipe(self, base: str) -> str:
        """The substitute's Dockerfile, built FROM `base` (the resolved Debian image)."""
        lines = [f"FROM {base}"]
        if self.packages:
            lines.append("RUN " + _APT.format(pkgs=" ".join(self.packages)))
        lines += [f"RUN {step}" for step in self.steps]
        lines += [f"ENV {k}={v}" for k, v in self.env]
        if self.workdir:
            lines.append(f"WORKDIR {self.workdir}")
        return "\n".join(lines) + "\n"


def _python(minor: str, suite: str, version: str) -> list[Alias]:
    base = ("python3", "python3-pip", "python3-venv", "python3-dev", "ca-certificates")
    env = (("LANG", "C.UTF-8"),)
    note = f"Debian {suite}'s Python {version}"
    return [
        Alias(
            rf"python:3\.{minor}(\.\d+)?-slim(-{suite}|-bookworm|-trixie)?",
            suite,
            base,
            (_PY_LINKS,),
            env,
            None,
            note,
        ),
        Alias(
            rf"python:3\.{minor}(\.\d+)?(-{suite}|-bookworm|-trixie)?",
            suite,
            base + _BUILD,
            (_PY_LINKS,),
            env,
            None,
            note + " with build tools",
        ),
    ]


_GO_ENV = (("GOPATH", "/go"), ("GOTOOLCHAIN", "local"))
_GO_PATH = ("PATH", "/go/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")

ALIASES: tuple[Alias, ...] = (
    Alias(
        r"ubuntu:(24\.04|noble|latest)",
        "trixie",
        steps=("useradd -m -u 1000 -s /bin/bash ubuntu",),
        note="Debian trixie (Ubuntu 24.04's contemporary), with the image's user `ubuntu` (uid 1000)",
    ),
    Alias(
        r"ubuntu:(22\.04|jammy|20\.04|focal)",
        "bookworm",
        note="Debian bookworm (Ubuntu 22.04's contemporary)",
    ),
    Alias(
        r"debian:(12|12\.\d+|bookworm-slim|12-slim|stable-slim)", "bookworm", note="the bootstrapped bookworm"
    ),
    Alias(r"debian:(13|13\.\d+|trixie-slim|13-slim|stable|latest)", "trixie", note="the bootstrapped trixie"),
    *_python("11", "bookworm", "3.11"),
    *_python("10", "bookworm", "3.11"),
    *_python("12", "trixie", "3.13"),
    *_python("13", "trixie", "3.13"),
    Alias(
        r"golang:1\.\d+(\.\d+)?(-bookworm|-trixie|-bullseye)?",
        "trixie",
        ("golang-go", "gcc", "libc6-dev", "make", "pkg-config", "git", "curl", "ca-certificates"),
        (_GO,),
        (*_GO_ENV, _GO_PATH),
        "/go",
        "Debian trixie's Go 1.24 (GOTOOLCHAIN=local)",
    ),
    Alias(
        r"gcc:\d+(\.\d+)*(-bookworm|-trixie)?",
        "trixie",
        _BUILD + ("gfortran",),
        note="Debian trixie's GCC 14",
    ),
    Alias(
        r"(eclipse-temurin|openjdk|amazoncorretto):17([.\w-]*)?",
        "bookworm",
        ("openjdk-17-jdk-headless", "ca-certificates", "curl"),
        (_JAVA_DIR,),
        (("JAVA_HOME", "/opt/java/openjdk"),),
        None,
        "Debian bookworm's OpenJDK 17",
    ),
    Alias(
        r"(eclipse-temurin|openjdk|amazoncorretto):21([.\w-]*)?",
        "trixie",
        ("openjdk-21-jdk-headless", "ca-certificates", "curl"),
        (_JAVA_DIR,),
        (("JAVA_HOME", "/opt/java/openjdk"),),
        None,
        "Debian trixie's OpenJDK 21",
    ),
    Alias(
        r"node:(20|22)(\.[\d.]+)?(-slim)?(-bookworm|-trixie)?",
        "trixie",
        ("nodejs", "npm", "ca-certificates"),
        note="Debian trixie's Node.js 20",
    ),
    Alias(
        r"node:18(\.[\d.]+)?(-slim)?(-bookworm)?",
        "bookworm",
        ("nodejs", "npm", "ca-certificates"),
        note="Debian bookworm's Node.js 18",
    ),
    Alias(
        r"rust:1(\.\d+)*(-slim)?(-bookworm|-trixie)?",
        "trixie",
        ("rustc", "cargo", "gcc", "libc6-dev", "ca-certificates"),
        env=(("CARGO_HOME", "/usr/local/cargo"),),
        note="Debian trixie's Rust 1.85",
    ),
)
_COMPILED = tuple((re.compile(a.pattern), a) for a in ALIASES)


def find_alias(ref: ImageRef) -> Alias | None:
    """The built-in substitute for `ref`, or None (always None for a digest-pinned reference)."""
    if ref.pinned or ref.registry != HUB or not ref.repository.startswith("library/"):
        return None
    familiar = f"{ref.repository.removeprefix('library/')}:{ref.tag}"
    for pattern, alias in _COMPILED:
        if pattern.fullmatch(familiar):
            return alias
    return None
