"""Image references: `ubuntu:24.04`, `ghcr.io/astral-sh/uv:0.9`, `python@sha256:...`, normalized.

Concept: a reference names a registry, a repository, a tag and/or a digest. `parse_ref` applies
Docker's defaults (registry `docker.io`, namespace `library/` for a one-part name on Docker Hub,
tag `latest` when neither tag nor digest is given) and one equivalence: ECR Public's copy of the
Docker official images (`public.ecr.aws/docker/library/NAME`) is the same image as
`docker.io/library/NAME`, so both look up the same mirror path and alias.

Invariant: a reference with a digest is pinned: whatever provides it must hold exactly that
manifest (a substitute never does, so a pinned reference is never aliased).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from miles_env.errors import ConfigError

__all__ = ["ImageRef", "parse_ref", "HUB"]

HUB = "docker.io"
_ECR_LIBRARY = "public.ecr.aws/docker/library/"
_NAME = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[0-9a-fA-F]{32,}$")


@dataclass(frozen=True, slots=True)
class ImageRef:
    registry: str  # "docker.io", "ghcr.io", "127.0.0.1:5000"
    repository: str  # "library/ubuntu", "astral-sh/uv"
    tag: str | None = None
    digest: str | None = None  # "sha256:..."

    @property
    def pinned(self) -> bool:
        return self.digest is not None

    @property
    def name(self) -> str:
        """`registry/repository` (no tag or digest)."""
        return f"{self.registry}/{self.repository}"

    @property
    def full(self) -> str:
        """The fully qualified reference, as a registry client takes it."""
        out = self.name
        if self.tag is not None:
            out += f":{self.tag}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out

    @property
    def familiar(self) -> str:
        """The short form people write (`ubuntu:24.04`, `ghcr.io/astral-sh/uv:0.9`), for messages."""
        name = self.name
        if self.registry == HUB:
            name = self.repository.removeprefix("library/")
        out = name + (f":{self.tag}" if self.tag is not None else "")
        return out + (f"@{self.digest}" if self.digest is not None else "")

    def at(self, registry: str, prefix: str = "") -> ImageRef:
        """The same repository, tag and digest under another registry (a mirror's path)."""
        repo = f"{prefix.strip('/')}/{self.repository}" if prefix.strip("/") else self.repository
        return ImageRef(registry, repo, self.tag, self.digest)

    def with_digest(self, digest: str) -> ImageRef:
        return ImageRef(self.registry, self.repository, self.tag, digest)


def _has_registry(first: str) -> bool:
    return "." in first or ":" in first or first == "localhost"


def parse_ref(text: str) -> ImageRef:
    """Parse and normalize an image reference; a malformed one is a ConfigError naming it."""
    ref = text.strip()
    digest = None
    if "@" in ref:
        ref, digest = ref.split("@", 1)
        if not _DIGEST.match(digest):
            raise ConfigError(f"image {text!r}: malformed digest {digest!r}")
    tag = None
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:
        ref, tag = ref[:colon], ref[colon + 1 :]
        if not _TAG.match(tag):
            raise ConfigError(f"image {text!r}: malformed tag {tag!r}")
    if ref.startswith(_ECR_LIBRARY):
        ref = "library/" + ref[len(_ECR_LIBRARY) :]
    first, _, rest = ref.partition("/")
    if rest and _has_registry(first):
        registry, repository = first, rest
    else:
        registry, repository = HUB, ref
    if registry in ("index.docker.io", "registry-1.docker.io"):
        registry = HUB
    if registry == HUB and "/" not in repository:
        repository = f"library/{repository}"
    if not repository or not _NAME.match(repository):
        raise ConfigError(f"image {text!r}: malformed repository name {repository!r}")
    if tag is None and digest is None:
        tag = "latest"
    return ImageRef(registry, repository, tag, digest)
