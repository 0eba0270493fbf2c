"""Task images built by dockerd: bases resolved as the local builder's are, RUN steps with network.

Concept: `DockerBuilder.build(context)` plans the build with sandboxes/images (the same
resolution, cache key and lowered Dockerfile as the local provider's buildah build), makes each
base present in the engine under a local name (`miles-env/base:<hash>`: pulled by digest, and
for a substitute built from its recipe), and has dockerd build the task's Dockerfile with a
build network: the engine's default bridge, or the host's where the engine has no bridge
(scripts/start-dockerd.sh runs dockerd with --bridge=none, where the default has no network).
An image already in the engine under the name the Dockerfile uses is used as is (a local
base, as `docker build` finds it). The result is tagged `miles-env/build:<key>`; a tag present
means built (the cache), and a per-key lock makes concurrent builds of one context one build.

Names used in the engine are ours only (`miles-env/...`, or the namespace ImagesConfig names): a
substitute never takes the name of the image it stands in for.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import docker
import docker.errors

from miles_env.sandboxes.images.config import ImagesConfig
from miles_env.sandboxes.images.context import lock, plan_build
from miles_env.sandboxes.images.errors import ImageError, unreached
from miles_env.sandboxes.images.refs import ImageRef
from miles_env.sandboxes.images.resolve import ProbeFailed, ResolvedImage, Resolver
from miles_env.sandboxes.images.wheels import stage as stage_wheels

__all__ = ["DockerBuilder", "DockerProbe"]

_CAUSES = ("no such host", "manifest unknown", "connection refused", "unauthorized", "not found", "timeout")


class DockerProbe:
    """resolve.Probe through the engine's distribution endpoint (its credentials and mirrors)."""

    def __init__(self, client: docker.DockerClient) -> None:
        self.client = client

    def digest(self, ref: ImageRef, insecure: bool) -> str:
        try:
            return str(self.client.images.get_registry_data(ref.full).id)
        except docker.errors.APIError as e:
            text = str(e.explanation or e)
            raise ProbeFailed(next((c for c in _CAUSES if c in text.lower()), text[-160:])) from e

    def local(self, requested: str) -> ResolvedImage | None:
        """An image the engine already has under this exact name, as `docker build` would use."""
        try:
            image = self.client.images.get(requested)
        except docker.errors.ImageNotFound:
            return None
        except docker.errors.APIError:
            return None
        note = f"the engine's own {requested}"
        return ResolvedImage(requested, str(image.id), str(image.id), "local", note=note)


def _log_text(log: str) -> str:
    return "\n".join(log.rstrip().splitlines()[-25:])[-3000:]


class DockerBuilder:
    builder_id = "dockerd-1"

    def __init__(self, client: docker.DockerClient, config: ImagesConfig, network: str | None = None) -> None:
        self.client = client
        self.config = config
        self.probe = DockerProbe(client)
        self.resolver = Resolver(config, self.probe, local=self.probe.local)
        self._network = network

    def network(self) -> str | None:
        if self._network is None:
            has_bridge = bool(self.client.networks.list(names=["bridge"]))
            self._network = "default" if has_bridge else "host"
        return None if self._network == "default" else self._network

    def _base_name(self, base: ResolvedImage) -> str:
        return f"{self.config.repo('base')}:{hashlib.sha256(base.key.encode()).hexdigest()[:20]}"

    def has(self, name: str) -> bool:
        try:
            self.client.images.get(name)
            return True
        except docker.errors.ImageNotFound:
            return False

    def build(self, context: Path) -> tuple[str, tuple[ResolvedImage, ...]]:
        """The engine's tag of the image built from `context`, and the bases it was built on."""
        plan = plan_build(context.absolute(), self.resolver, self.builder_id, self._base_name)
        tag = f"{self.config.repo('build')}:{plan.key[:16]}"
        try:
            if self.has(tag):
                return tag, plan.bases
            with lock(self.config.cache() / "locks" / f"docker-{plan.key[:32]}.lock"):
                if not self.has(tag):
                    for base in plan.bases:
                        self._ensure_base(base)
                    with tempfile.TemporaryDirectory(prefix="miles-env-df-") as tmp:
                        df = plan.write_dockerfile(Path(tmp) / "Dockerfile")
                        self._build(plan.context, df, tag, str(plan.source))
        finally:
            plan.cleanup()
        return tag, plan.bases

    def _ensure_base(self, base: ResolvedImage) -> None:
        name = self._base_name(base)
        if self.has(name):
            return
        if base.source == "local":
            self.client.images.get(base.ref).tag(name)
            return
        try:
            pulled = self.client.images.pull(base.ref)
        except docker.errors.APIError as e:
            raise ImageError(f"pulling {base.ref} (for {base.requested}): {e.explanation or e}") from e
        if base.recipe is None:
            pulled.tag(name)
            return
        cache = self.config.cache()
        with tempfile.TemporaryDirectory(prefix="miles-env-alias-", dir=cache) as ctx:
            stage_wheels(tuple(base.wheels), Path(ctx), cache)
            (Path(ctx) / "Dockerfile").write_text(base.recipe_from(base.ref))
            self._build(Path(ctx), Path(ctx) / "Dockerfile", name, f"the substitute for {base.requested}")

    def _build(self, context: Path, dockerfile: Path, tag: str, what: str) -> None:
        try:
            self.client.images.build(
                path=str(context),
                dockerfile=str(dockerfile),
                tag=tag,
                pull=False,
                network_mode=self.network(),
                rm=True,
                forcerm=True,
                timeout=int(self.config.build_timeout_s),
            )
        except docker.errors.BuildError as e:
            log = "".join(
                str(x.get("stream", x.get("error", ""))) for x in e.build_log if isinstance(x, dict)
            )
            why = unreached(log)
            cause = f"{e}; {why}" if why else str(e)
            raise ImageError(f"docker build of {what} failed: {cause}\n{_log_text(log)}") from e
        except docker.errors.APIError as e:
            raise ImageError(f"docker build of {what} failed: {e.explanation or e}") from e
