"""Task images for the local provider: built by buildah, unpacked once as a root filesystem.

Concept: `LocalImages.get(spec)` turns a SandboxSpec's `build` (a Docker build context) or
`image` (a reference) into a `LocalImage`: a directory holding the image's files, exactly as the
image has them (owners, modes, links), and its ImageConfig (Env, User, WorkingDir, Entrypoint,
Cmd). The build is the task author's: bases pulled (resolve.py), RUN steps with network (a private
bridge by default), as `docker build` does. Layout under `<images cache>`:
    rootfs/<key>/root/        the image's files (device nodes removed: a sandbox brings its own /dev;
                              /dev, /proc, /sys, /tmp made where missing, as a container runtime does)
    rootfs/<key>/image.json   its ImageConfig, bases and key; written last, so its presence means done
    locks/<key>.lock          held while one process builds and unpacks that key
    containers/               buildah's storage (bases and substitutes stay; built images are removed
                              once unpacked: the root filesystem is the cache)

Invariant: a key is built and unpacked at most once, however many processes ask at once; a
failed build leaves nothing under rootfs/ and raises an ImageError with the build log's tail.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_env.types import SandboxSpec

from .config import ImagesConfig
from .context import BuildPlan, lock, plan_build
from .errors import ImageError, unreached
from .oci import ImageConfig
from .resolve import ResolvedImage, Resolver
from .tools import Buildah, SkopeoProbe, log_tail
from .wheels import stage as stage_wheels

__all__ = ["LocalImage", "LocalImages"]


@dataclass(frozen=True, slots=True)
class LocalImage:
    key: str
    rootfs: Path  # the root filesystem directory (read-only to sandboxes: lay a writable layer over it)
    config: ImageConfig
    bases: tuple[ResolvedImage, ...]
    built: bool  # False when it came from the cache

    @property
    def substituted_from(self) -> tuple[str, ...]:
        return tuple(b.substituted_from for b in self.bases if b.substituted_from is not None)

    def metadata(self) -> dict[str, Any]:
        """For an episode's metadata: the image's key and where each base came from."""
        return {"key": self.key, "bases": [b.metadata() for b in self.bases]}


def _base_name(base: ResolvedImage) -> str:
    return f"localhost/miles-env/base:{hashlib.sha256(base.key.encode()).hexdigest()[:20]}"


class LocalImages:
    """One per provider: resolves through skopeo, builds with buildah, keeps what it resolved."""

    builder_id = "buildah-3"  # part of every build's key: bumped when what an unpacked image keeps changes

    def __init__(self, config: ImagesConfig | None = None) -> None:
        self.config = config or ImagesConfig()
        self.cache = self.config.cache()
        self.buildah = Buildah(self.cache)
        self.resolver = Resolver(self.config, SkopeoProbe(self.config.probe_timeout_s))

    def get(self, spec: SandboxSpec) -> LocalImage:
        """The image for `spec.build` (or `spec.image`), built and unpacked unless cached."""
        if spec.build is not None and spec.image is None:
            return self.build(Path(spec.build))
        if spec.image is None:
            raise ImageError("SandboxSpec has neither build nor image")
        with tempfile.TemporaryDirectory(prefix="miles-env-image-") as empty:
            return self.build(Path(empty), f"FROM {spec.image}\n", label=spec.image)

    def build(self, context: Path, dockerfile: str | None = None, *, label: str | None = None) -> LocalImage:
        plan = plan_build(context.absolute(), self.resolver, self.builder_id, _base_name, dockerfile)
        try:
            done = self._cached(plan.key)
            if done is not None:
                return done
            with lock(self.cache / "locks" / f"{plan.key}.lock"):
                done = self._cached(plan.key)  # built by another process while we waited
                if done is not None:
                    return done
                for base in plan.bases:
                    self._ensure_base(base)
                return self._build_and_unpack(plan, label or str(plan.source))
        finally:
            plan.cleanup()

    def _dir(self, key: str) -> Path:
        return self.cache / "rootfs" / key[:32]

    def _cached(self, key: str) -> LocalImage | None:
        meta = self._dir(key) / "image.json"
        if not meta.is_file():
            return None
        data = json.loads(meta.read_text())
        bases = tuple(ResolvedImage(**{**b, "wheels": tuple(b.get("wheels") or ())}) for b in data["bases"])
        c = data["config"]
        config = ImageConfig(
            env=c["env"],
            user=c["user"],
            workdir=c["workdir"],
            entrypoint=tuple(c["entrypoint"]),
            cmd=tuple(c["cmd"]),
        )
        return LocalImage(key, self._dir(key) / "root", config, bases, built=False)

    def _ensure_base(self, base: ResolvedImage) -> None:
        """The base in buildah's storage under its local name: pulled, and built if a substitute."""
        name = _base_name(base)
        if self.buildah.exists(name):
            return
        with lock(self.cache / "locks" / f"base-{name.rsplit(':', 1)[1]}.lock"):
            if self.buildah.exists(name):
                return
            image_id = self.buildah.pull(base.ref, base.insecure, self.config.build_timeout_s)
            if base.recipe is None:
                self.buildah.run(["tag", image_id, name], f"tagging {base.requested}", timeout=60)
                return
            # in the cache: its wheels' files are hard links to the cached ones (wheels.stage)
            with tempfile.TemporaryDirectory(prefix="miles-env-alias-", dir=self.cache) as ctx:
                stage_wheels(tuple(base.wheels), Path(ctx), self.cache)
                df = Path(ctx) / "Dockerfile"
                df.write_text(base.recipe_from(image_id))
                log = self.buildah.logs / f"substitute-{name.rsplit(':', 1)[1]}.log"
                self._build(Path(ctx), df, name, log, f"the substitute for {base.requested}")

    def _build(self, context: Path, dockerfile: Path, tag: str, log: Path, what: str) -> str:
        try:
            return self.buildah.build(
                context,
                dockerfile,
                tag,
                network=self.config.build_network,
                timeout=self.config.build_timeout_s,
                log=log,
            )
        except (
            ImageError
        ) as e:  # its cause ("buildah exited 1 (log ...)", "still running after 1800 s"), then the log
            cause = str(e).splitlines()[0].rsplit(": ", 1)[-1]
            why = unreached(log.read_text(errors="replace")) if log.is_file() else None
            cause += f"; {why}" if why else ""
            raise ImageError(f"building {what} failed: {cause}\n{log_tail(log)}") from e

    def _build_and_unpack(self, plan: BuildPlan, label: str) -> LocalImage:
        tag = f"localhost/miles-env/build:{plan.key[:20]}"
        log = self.buildah.logs / f"build-{plan.key[:20]}.log"
        with tempfile.TemporaryDirectory(prefix="miles-env-df-") as tmp:
            dockerfile = plan.write_dockerfile(Path(tmp) / "Dockerfile")
            image_id = self._build(plan.context, dockerfile, tag, log, label)
        info = self.buildah.inspect(image_id)
        config = ImageConfig.from_oci((info.get("OCIv1") or {}).get("config"))
        dest = self._dir(plan.key)
        self._unpack(image_id, dest)
        meta = {
            "key": plan.key,
            "config": {
                "env": dict(config.env),
                "user": config.user,
                "workdir": config.workdir,
                "entrypoint": list(config.entrypoint),
                "cmd": list(config.cmd),
            },
            "bases": [{f: getattr(b, f) for f in ResolvedImage.__slots__} for b in plan.bases],
        }
        (dest / "image.json").write_text(json.dumps(meta, indent=1))
        self.buildah.run(["rmi", "--force", tag], f"removing {tag}", timeout=120)
        return LocalImage(plan.key, dest / "root", config, plan.bases, built=True)

    def _unpack(self, image_id: str, dest: Path) -> None:
        """Copy the image's files into dest/root (through a temporary dir: all or nothing)."""
        staging = dest.with_name(dest.name + f".tmp{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            self.buildah.unpack(image_id, staging / "root", timeout=self.config.build_timeout_s)
            _strip_devices(staging / "root")
            for mountpoint in ("dev", "proc", "sys", "tmp"):  # as a container runtime makes them
                path = staging / "root" / mountpoint
                if not path.is_symlink():
                    path.mkdir(mode=0o1777 if mountpoint == "tmp" else 0o755, exist_ok=True)
            staging.rename(dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def _strip_devices(root: Path) -> None:
    """Remove device nodes (a sandbox mounts its own /dev; elsewhere they are an escape route)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                os.unlink(path)
