"""ImagesConfig: where task images come from and where they are kept (pydantic and stdlib only).

A provider's config holds one (`sandbox: {provider: local, images: {mirrors: {...}}}`); the
environment adds to it, so one machine-wide setting reaches every run:
- `MILES_ENV_REGISTRY_MIRROR`: comma-separated `[registry=]location`; a bare location mirrors
  Docker Hub (`mirror.corp:5000`, `docker.io=mirror.corp:5000/hub,ghcr.io=mirror.corp:5000/ghcr`).
  A location starting `http://` is plain HTTP (an in-house registry without TLS).
- `MILES_ENV_IMAGE_ALIASES`: comma-separated `ref=substitute` pairs, the user's own aliases.
- `MILES_ENV_CACHE`: the cache root (images live in `$MILES_ENV_CACHE/images`).
- `MILES_ENV_UBUNTU_ARCHIVE=0`: `ubuntu_archive` off (Debian stand-ins for Ubuntu's images).
- `MILES_ENV_IMAGE_NAMESPACE`: the repository prefix of what is built in a docker engine
  (`miles-env/build:*`, `miles-env/base:*`): a test session sets its own, so a user's runs on the
  same engine and the session neither share nor remove each other's images (tests/host_leftovers.py).
The config's own entries win over the environment's for the same registry or reference.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ImagesConfig", "Mirror", "cache_root"]


def cache_root() -> Path:
    """$MILES_ENV_CACHE, else ~/.cache/miles-env (the project's one cache root)."""
    return Path(os.environ.get("MILES_ENV_CACHE") or Path.home() / ".cache" / "miles-env")


class Mirror(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str  # "mirror.corp:5000"
    prefix: str = ""  # path inside the mirror before the repository ("hub" in mirror.corp:5000/hub)
    insecure: bool = False  # plain HTTP

    @classmethod
    def parse(cls, location: str) -> Mirror:
        insecure = location.startswith("http://")
        bare = location.removeprefix("http://").removeprefix("https://").strip("/")
        host, _, prefix = bare.partition("/")
        return cls(host=host, prefix=prefix, insecure=insecure)


def _pairs(text: str | None, default_key: str | None = None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if sep:
            out[key.strip()] = value.strip()
        elif default_key is not None:
            out[default_key] = key
    return out


class ImagesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cache_dir: str | None = Field(None, description="image cache; None = $MILES_ENV_CACHE/images")
    mirrors: dict[str, str] = Field(
        default_factory=dict,
        description="registry -> mirror location (any OCI registry; `http://` = plain HTTP), tried first; "
        "$MILES_ENV_REGISTRY_MIRROR adds to it",
    )
    aliases: dict[str, str] = Field(
        default_factory=dict,
        description="your own substitutes: image reference -> the reference to use instead (digest-pinned "
        "references too: naming one here is the explicit choice); $MILES_ENV_IMAGE_ALIASES adds to it",
    )
    builtin_aliases: bool = Field(
        True, description="offline only: map common bases (ubuntu, python, golang, gcc...) to Debian builds"
    )
    ubuntu_archive: bool = Field(
        True,
        description="offline substitutes for ubuntu:24.04/22.04 and python:3.12 built on Ubuntu's own noble/jammy "
        "(bootstrapped from the Ubuntu archive: the real image's packages and versions); where that archive is "
        "not reachable (bootstrap skipped them), or with this off, on Debian's trixie/bookworm instead; "
        "$MILES_ENV_UBUNTU_ARCHIVE=0 turns it off",
    )
    direct: bool = Field(True, description="try each image's own registry (Docker Hub, ghcr.io...) too")
    build_network: Literal["private", "host"] = Field(
        "private",
        description="network of RUN steps (local builder): `private` = a bridge of its own with NAT, "
        "which reaches the internet but not this host's loopback; `host` = this host's",
    )
    namespace: str | None = Field(
        None,
        pattern=r"^[a-z0-9]+([._-][a-z0-9]+)*$",
        description="repository prefix of the images built in a docker engine (NS/build:*, NS/base:*); "
        "None = $MILES_ENV_IMAGE_NAMESPACE or miles-env",
    )
    build_timeout_s: float = Field(1800.0, gt=0, description="wall time of one image build")
    probe_timeout_s: float = Field(20.0, gt=0, description="wall time of one registry lookup")

    def cache(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else cache_root() / "images"

    def repo(self, name: str) -> str:
        """The engine's repository for `name` ("build", "base", "rootfs") under the namespace."""
        return f"{self.namespace or os.environ.get('MILES_ENV_IMAGE_NAMESPACE') or 'miles-env'}/{name}"

    def ubuntu(self) -> bool:
        """Whether the Ubuntu suites stand in for Ubuntu's images (this config or the environment)."""
        return self.ubuntu_archive and os.environ.get("MILES_ENV_UBUNTU_ARCHIVE", "1") != "0"

    def mirror_table(self) -> dict[str, Mirror]:
        table = {**_pairs(os.environ.get("MILES_ENV_REGISTRY_MIRROR"), "docker.io"), **self.mirrors}
        return {registry: Mirror.parse(location) for registry, location in table.items()}

    def alias_table(self) -> dict[str, str]:
        return {**_pairs(os.environ.get("MILES_ENV_IMAGE_ALIASES")), **self.aliases}
