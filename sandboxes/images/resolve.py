"""Which image a build's `FROM ubuntu:24.04` really gets, tried in a fixed order.

Order, first hit wins: (0) the builder's own store, where it has one (an image dockerd already
holds under that name, as `docker build` uses it); (1) your own alias for exactly this reference (the explicit choice: may
name a digest-pinned one); (2) each configured mirror of its registry; (3) its own registry
(Docker Hub, ghcr.io, ...); (4) the loopback registry, for the bases bootstrap made
(`debian:bookworm`, `debian:trixie`, `ubuntu:noble`, ...); (5) the built-in alias table
(aliases.py), offline only, never for a pinned reference; an entry on an Ubuntu suite takes its
Debian fallback unless `ubuntu_archive` is on and that suite was bootstrapped. Nothing else: a reference none of them provides is a
BaseUnavailable naming it, what was tried, and the two remedies (a mirror, an alias).

A lookup asks a registry for the manifest's digest (`Probe`: skopeo for the local builder,
dockerd for the docker one; the loopback registry over HTTP); the result pins the pull, so the
build's cache key changes exactly when the base does. Results are kept for the resolver's life
(a provider's), so a run asks once per reference; a substitute is logged on every use.

Lifecycle: a Resolver per builder; the loopback registry starts only when step (4) or (5) needs it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .aliases import find_alias
from .config import ImagesConfig
from .errors import BaseUnavailable, ImageError
from .refs import HUB, ImageRef, parse_ref
from .registry import LoopbackRegistry, registry_for
from .suites import SUITES

__all__ = ["Probe", "ProbeFailed", "ResolvedImage", "Resolver", "unavailable_message"]

_log = logging.getLogger(__name__)


class ProbeFailed(Exception):
    """A registry lookup failed; the message is the one-line reason (no such host, 404, ...)."""


class Probe(Protocol):
    def digest(self, ref: ImageRef, insecure: bool) -> str:
        """The manifest digest of `ref` in its registry; ProbeFailed with the reason otherwise."""
        ...


@dataclass(frozen=True, slots=True)
class ResolvedImage:
    requested: str  # as the Dockerfile wrote it (ARGs expanded): "ubuntu:24.04"
    ref: str  # what is pulled, fully qualified and pinned: "127.0.0.1:41234/library/debian@sha256:..."
    digest: str
    source: str  # "local" | "alias" (yours) | "mirror" | "direct" | "bootstrap" | "substitute" (built-in)
    insecure: bool = False  # pulled over plain HTTP (the loopback registry, an http:// mirror)
    substituted_from: str | None = None  # set when what runs is not the image asked for
    recipe: str | None = None  # a substitute's Dockerfile (its FROM names the Debian base), built on `ref`
    note: str = ""
    wheels: tuple[str, ...] = ()  # PyPI wheels the recipe's context holds (wheels.stage), named in the recipe

    @property
    def key(self) -> str:
        """What the build's cache key takes from this base: its digest and the recipe on top."""
        recipe = hashlib.sha256((self.recipe or "").encode()).hexdigest()[:16]
        return f"{self.digest}+{recipe}" if self.recipe else self.digest

    def recipe_from(self, image: str) -> str:
        """The substitute's Dockerfile built FROM `image` (the base as the builder holds it)."""
        assert self.recipe is not None
        return f"FROM {image}\n" + self.recipe.split("\n", 1)[1]

    def metadata(self) -> dict[str, str | None]:
        """For an episode's metadata: what was asked, what ran, where it came from."""
        return {
            "requested": self.requested,
            "digest": self.digest,
            "source": self.source,
            "substituted_from": self.substituted_from,
            "note": self.note,
        }


def unavailable_message(requested: str, tried: list[str]) -> str:
    example = "host:5000"
    return (
        f"base image {requested!r} cannot be had here (tried: {'; '.join(tried) or 'nothing'}); provide it "
        f"through a registry mirror (sandbox.images.mirrors, or MILES_ENV_REGISTRY_MIRROR={example}) or an "
        f"alias to an image you have (sandbox.images.aliases, or MILES_ENV_IMAGE_ALIASES='{requested}=IMAGE')"
    )


class Resolver:
    def __init__(
        self,
        config: ImagesConfig,
        probe: Probe,
        registry: LoopbackRegistry | None = None,
        local: Callable[[str], ResolvedImage | None] | None = None,
    ) -> None:
        self.config = config
        self.probe = probe
        self._registry = registry
        self._local = local  # the builder's own store, asked first (dockerd's images)
        self._memo: dict[str, ResolvedImage] = {}
        self._lock = threading.Lock()

    @property
    def registry(self) -> LoopbackRegistry:
        if self._registry is None:
            self._registry = registry_for(self.config.cache())
        return self._registry

    def resolve(self, requested: str) -> ResolvedImage:
        with self._lock:
            hit = self._memo.get(requested)
        if hit is None:
            hit = self._resolve(requested)
            with self._lock:
                self._memo[requested] = hit
        if hit.substituted_from is not None:
            _log.warning("image %s: %s", requested, hit.note)
        return hit

    def _resolve(self, requested: str) -> ResolvedImage:
        ref = parse_ref(requested)
        aliases = self.config.alias_table()
        mine = aliases.get(requested) or aliases.get(ref.familiar) or aliases.get(ref.full)
        if mine is not None:
            target = self._registries(parse_ref(mine), [])
            if target is None:
                raise BaseUnavailable(unavailable_message(mine, [f"your alias {requested} -> {mine}"]))
            note = f"your alias: {requested} -> {mine} ({target.source})"
            return _replace(target, requested, "alias", requested, note)
        if self._local is not None and (here := self._local(requested)) is not None:
            return here
        tried: list[str] = []
        found = self._registries(ref, tried)
        if found is not None:
            return _replace(found, requested, found.source, None, found.note)
        alias = None if ref.pinned else (find_alias(ref) if self.config.builtin_aliases else None)
        if alias is not None:
            base = None
            if self.config.ubuntu() or alias.fallback is None:
                base = self._registries(parse_ref(SUITES[alias.suite].image), tried)
            if base is None and alias.fallback is not None:
                alias = alias.fallback
                base = self._registries(parse_ref(SUITES[alias.suite].image), tried)
            if base is None:
                raise BaseUnavailable(unavailable_message(requested, tried) + _bootstrap_hint(alias.suite))
            image = SUITES[alias.suite].image
            note = f"substituted (offline only): {alias.note}, built on {image} ({base.source})"
            return ResolvedImage(
                requested,
                base.ref,
                base.digest,
                "substitute",
                base.insecure,
                requested,
                alias.recipe(image),  # names the base stably: no port in the key
                note,
                tuple(req for req, _folder, _dest in alias.wheels),
            )
        if ref.pinned:
            tried.append("pinned by digest: never substituted")
        elif self.config.builtin_aliases:
            tried.append("no built-in alias")
        raise BaseUnavailable(unavailable_message(requested, tried))

    def _registries(self, ref: ImageRef, tried: list[str]) -> ResolvedImage | None:
        """Mirrors, then the image's own registry, then the loopback registry's bootstrapped bases."""
        mirror = self.config.mirror_table().get(ref.registry)
        if mirror is not None:
            found = self._probe(ref.at(mirror.host, mirror.prefix), mirror.insecure, "mirror", tried)
            if found is not None:
                return found
        else:
            tried.append(f"no mirror of {ref.registry} configured")
        if self.config.direct:
            found = self._probe(ref, False, "direct", tried)
            if found is not None:
                return found
        return self._bootstrapped(ref, tried)

    def _probe(self, ref: ImageRef, insecure: bool, source: str, tried: list[str]) -> ResolvedImage | None:
        if ref.digest is not None:  # the digest decides (registry clients refuse tag + digest together)
            ref = ImageRef(ref.registry, ref.repository, None, ref.digest)
        try:
            digest = self.probe.digest(ref, insecure)
        except ProbeFailed as e:
            tried.append(f"{ref.registry}: {e}")
            return None
        if ref.digest is not None and digest != ref.digest:
            tried.append(f"{ref.registry}: has {digest}, not the pinned {ref.digest}")
            return None
        pinned = ImageRef(ref.registry, ref.repository, None, digest)
        return ResolvedImage(ref.familiar, pinned.full, digest, source, insecure, note=f"from {ref.full}")

    def _bootstrapped(self, ref: ImageRef, tried: list[str]) -> ResolvedImage | None:
        suite = SUITES.get(ref.tag or "")
        if ref.registry != HUB or suite is None or ref.repository != f"library/{suite.distro}":
            return None
        try:
            digest = self.registry.digest(ref.repository, suite.name)
            addr = self.registry.address()
        except ImageError as e:
            tried.append(str(e))
            return None
        if digest is None or (ref.digest is not None and digest != ref.digest):
            tried.append(f"loopback registry: no {ref.familiar} (run `miles-env images bootstrap`)")
            return None
        pinned = ImageRef(addr, ref.repository, None, digest)
        note = f"bootstrapped {suite.distro.capitalize()} {ref.tag} (mmdebstrap, the loopback registry)"
        return ResolvedImage(ref.familiar, pinned.full, digest, "bootstrap", True, note=note)


def _replace(
    found: ResolvedImage, requested: str, source: str, substituted_from: str | None, note: str
) -> ResolvedImage:
    return ResolvedImage(
        requested,
        found.ref,
        found.digest,
        source,
        found.insecure,
        substituted_from,
        found.recipe,
        note,
        found.wheels,
    )


def _bootstrap_hint(suite: str) -> str:
    return f"; its built-in substitute needs {SUITES[suite].image}: run `miles-env images bootstrap`"
