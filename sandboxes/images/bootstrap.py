"""`miles-env images bootstrap`: Debian bases made from the Debian archive, served by the loopback registry.

Concept: for each suite (bookworm, trixie), mmdebstrap makes a minbase root filesystem from the
Debian archive (the same recipe as the official `debian` images: minbase, merged /usr, apt
sources of the suite, its updates and security; docs, man pages and locales left out as in
`-slim`), buildah turns the tarball into an image (`FROM scratch`, `ADD`, Docker's default PATH,
`CMD ["bash"]`; this host's own CA certificates from /usr/local/share/ca-certificates, where
Debian's ca-certificates picks them up once a build installs it, so a build behind a TLS-inspecting
proxy trusts what the host trusts) and pushes it to the loopback registry as `library/debian:<suite>`, where builds
pull it like any registry image. Substitutes (aliases.py) build on these.

Invariant: idempotent; a suite already in the registry is skipped unless `refresh`. Once per
machine (the registry's storage is in the images cache), once per CI run (the cache starts empty).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .aliases import DEBIAN_SUITES
from .config import ImagesConfig
from .context import lock
from .errors import ImageError
from .registry import registry_for
from .tools import Buildah, log_tail, need_tool

__all__ = ["BootstrapResult", "bootstrap", "DEBIAN_MIRROR"]

DEBIAN_MIRROR = os.environ.get("MILES_ENV_DEBIAN_MIRROR", "http://deb.debian.org/debian")
_HOOKS = Path("/usr/share/mmdebstrap/hooks")
_EXCLUDE = ("man", "doc", "info", "locale", "lintian", "linda")
HOST_CAS = Path("/usr/local/share/ca-certificates")
_BASE_DOCKERFILE = (
    "FROM scratch\nADD rootfs.tar /\n{cas}"
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
    'CMD ["bash"]\n'
)


@dataclass(frozen=True, slots=True)
class BootstrapResult:
    suite: str
    digest: str
    seconds: float  # 0.0 when it was already there
    made: bool


def _sources(suite: str, mirror: str) -> list[str]:
    security = mirror.rsplit("/", 1)[0] + "/debian-security" if mirror.endswith("/debian") else mirror
    return [
        f"deb {mirror} {suite} main",
        f"deb {mirror} {suite}-updates main",
        f"deb {security} {suite}-security main",
    ]


def _mmdebstrap(suite: str, out: Path, log: Path, mirror: str, timeout: float) -> None:
    argv = [need_tool("mmdebstrap"), "--variant=minbase", "--format=tar", "--skip=output/dev"]
    argv += ['--aptopt=Acquire::Retries "3"', f"--hook-dir={_HOOKS / 'maybe-merged-usr'}"]
    if shutil.which("eatmydata"):
        argv.append(f"--hook-dir={_HOOKS / 'eatmydata'}")  # no fsync per unpacked file
    argv += [f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in _EXCLUDE]
    argv.append("--dpkgopt=path-include=/usr/share/doc/*/copyright")
    argv += [suite, str(out), *_sources(suite, mirror)]
    with log.open("wb") as f:
        try:
            proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ImageError(
                f"mmdebstrap {suite}: still running after {timeout:.0f} s\n{log_tail(log)}"
            ) from e
    if proc.returncode != 0:
        raise ImageError(f"mmdebstrap {suite} failed (exit {proc.returncode}, log {log})\n{log_tail(log)}")


def _host_cas(dest: Path) -> list[str]:
    """Copy this host's own CA certificates (Debian's place for local ones) into dest."""
    names = sorted(p.name for p in HOST_CAS.glob("*.crt")) if HOST_CAS.is_dir() else []
    if names:
        dest.mkdir()
        for name in names:
            shutil.copyfile(HOST_CAS / name, dest / name)
    return names


def _make(suite: str, config: ImagesConfig, buildah: Buildah, mirror: str, host_cas: bool) -> None:
    registry = registry_for(config.cache())
    with tempfile.TemporaryDirectory(prefix=f"miles-env-{suite}-", dir=config.cache()) as tmp:
        ctx = Path(tmp)
        log = buildah.logs / f"bootstrap-{suite}.log"
        _mmdebstrap(
            suite, ctx / "rootfs.tar", log.with_suffix(".mmdebstrap.log"), mirror, config.build_timeout_s
        )
        cas = _host_cas(ctx / "ca") if host_cas else []
        copy = "COPY ca/ /usr/local/share/ca-certificates/\n" if cas else ""
        (ctx / "Dockerfile").write_text(_BASE_DOCKERFILE.format(cas=copy))
        tag = f"localhost/miles-env/debian:{suite}"
        buildah.build(ctx, ctx / "Dockerfile", tag, network="none", timeout=config.build_timeout_s, log=log)
    target = f"docker://{registry.address()}/library/debian:{suite}"
    buildah.run(
        ["push", "--tls-verify=false", "--signature-policy", str(buildah.policy), tag, target],
        f"pushing debian:{suite} to the loopback registry",
        timeout=600,
    )
    buildah.run(["rmi", tag], f"removing {tag}", timeout=60)


def bootstrap(
    config: ImagesConfig | None = None,
    suites: tuple[str, ...] = DEBIAN_SUITES,
    *,
    refresh: bool = False,
    mirror: str = DEBIAN_MIRROR,
    host_cas: bool = True,
) -> list[BootstrapResult]:
    """Make and push each suite's base unless the loopback registry has it; one result per suite."""
    config = config or ImagesConfig()
    unknown = [s for s in suites if s not in DEBIAN_SUITES]
    if unknown:
        raise ImageError(
            f"bootstrap: unknown suite(s) {', '.join(unknown)}; known: {', '.join(DEBIAN_SUITES)}"
        )
    registry = registry_for(config.cache())
    buildah = Buildah(config.cache())

    def one(suite: str) -> BootstrapResult:
        with lock(config.cache() / "locks" / f"bootstrap-{suite}.lock"):
            digest = registry.digest("library/debian", suite)
            if digest is not None and not refresh:
                return BootstrapResult(suite, digest, 0.0, made=False)
            start = time.monotonic()
            _make(suite, config, buildah, mirror, host_cas)
            digest = registry.digest("library/debian", suite)
            if digest is None:
                raise ImageError(f"bootstrap: debian:{suite} was pushed but the registry does not list it")
            return BootstrapResult(suite, digest, time.monotonic() - start, made=True)

    # The suites at once: each mostly waits on the archive and the disk, not on a core.
    with ThreadPoolExecutor(max_workers=max(1, len(suites))) as pool:
        return list(pool.map(one, suites))
