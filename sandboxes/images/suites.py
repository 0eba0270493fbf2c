"""The bases `miles-env images bootstrap` can make: Debian and Ubuntu suites, each from its own archive.

Concept: a suite is a distribution's release as its archive serves it (Debian's bookworm and
trixie from deb.debian.org, Ubuntu's noble and jammy from archive.ubuntu.com), made into a
minbase root filesystem by mmdebstrap and served by the loopback registry as `<distro>:<suite>`
(`debian:trixie`, `ubuntu:noble`). The alias table builds its substitutes on them: `ubuntu:24.04`
on Ubuntu's own noble, where the Ubuntu archive is reachable, with the same packages at the same
versions as the real image's apt would install (R 4.3.3, Python 3.12, `file`'s closure), not
Debian's contemporaries.

Debian suites are required (every substitute falls back to one); Ubuntu suites are optional: a
machine whose only archive is Debian's skips them with one line, and the Ubuntu aliases fall back
to their Debian stand-ins. Each suite names the keyring that signs its archive (Ubuntu's comes
from Debian's `ubuntu-keyring` package, scripts/install-images.sh), so a bootstrap verifies
what it unpacks as apt does.

Invariant: a suite's image name is `<distro>:<name>`, one name per suite.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Suite", "SUITES", "DEBIAN_SUITES", "UBUNTU_SUITES", "suite_named"]

_DEBIAN = os.environ.get("MILES_ENV_DEBIAN_MIRROR", "http://deb.debian.org/debian")
_UBUNTU = os.environ.get("MILES_ENV_UBUNTU_MIRROR", "http://archive.ubuntu.com/ubuntu")
_UBUNTU_SECURITY = os.environ.get("MILES_ENV_UBUNTU_SECURITY_MIRROR", "http://security.ubuntu.com/ubuntu")
# What the real ubuntu:24.04 and 22.04 ship that mmdebstrap's minbase of Ubuntu leaves out (there
# apt is Priority: important, so not even apt): their package lists (docker-library/repo-info,
# repos/ubuntu/local/*.md) hold apt with ubuntu-keyring, procps (ps, pgrep, pkill), e2fsprogs
# (chattr) and sensible-utils. A task checks its services with `pgrep`.
_UBUNTU_IMAGE_TOOLS = ("apt", "ubuntu-keyring", "procps", "e2fsprogs", "sensible-utils")


@dataclass(frozen=True, slots=True)
class Suite:
    name: str  # "noble"
    distro: str  # "debian" | "ubuntu"
    mirror: str
    security: str
    components: tuple[str, ...] = ("main",)
    keyring: str | None = None  # None: the host apt's own trusted keys (Debian's)
    include: tuple[str, ...] = ()  # packages beyond minbase
    user: str | None = None  # the image's own user, uid 1000 (ubuntu:24.04 has `ubuntu`)
    required: bool = True  # a default bootstrap fails without it (else: one line, skipped)

    @property
    def image(self) -> str:
        return f"{self.distro}:{self.name}"

    def sources(self) -> list[str]:
        comps = " ".join(self.components)
        return [
            f"deb {self.mirror} {self.name} {comps}",
            f"deb {self.mirror} {self.name}-updates {comps}",
            f"deb {self.security} {self.name}-security {comps}",
        ]


def _debian(name: str) -> Suite:
    security = _DEBIAN.rsplit("/", 1)[0] + "/debian-security" if _DEBIAN.endswith("/debian") else _DEBIAN
    return Suite(name, "debian", _DEBIAN, security)


def _ubuntu(name: str, user: str | None) -> Suite:
    return Suite(
        name,
        "ubuntu",
        _UBUNTU,
        _UBUNTU_SECURITY,
        ("main", "universe"),
        "/usr/share/keyrings/ubuntu-archive-keyring.gpg",
        _UBUNTU_IMAGE_TOOLS,
        user,
        required=False,
    )


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (_debian("bookworm"), _debian("trixie"), _ubuntu("noble", "ubuntu"), _ubuntu("jammy", None))
}
DEBIAN_SUITES = tuple(n for n, s in SUITES.items() if s.distro == "debian")
UBUNTU_SUITES = tuple(n for n, s in SUITES.items() if s.distro == "ubuntu")


def suite_named(name: str) -> Suite:
    try:
        return SUITES[name]
    except KeyError:
        raise KeyError(f"unknown suite {name!r}; known: {', '.join(SUITES)}") from None
