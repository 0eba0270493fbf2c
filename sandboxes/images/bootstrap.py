"""`miles-env images bootstrap`: Debian and Ubuntu bases made from their archives, served by the loopback registry.

Concept: for each suite (suites.py: Debian's bookworm and trixie, Ubuntu's noble and jammy),
mmdebstrap makes a minbase root filesystem from the suite's archive (the same recipe as the
official `debian` and `ubuntu` images: minbase, merged /usr, apt sources of the suite, its updates
and security; docs, man pages and locales left out as in `-slim`; Ubuntu's with the tools its
image ships and its user), buildah turns the tarball into an image (`FROM scratch`, `ADD`,
Docker's default PATH, `CMD ["bash"]`; this host's own CA certificates from
/usr/local/share/ca-certificates, where ca-certificates picks them up once a build installs it, so
a build behind a TLS-inspecting proxy trusts what the host trusts) and pushes it to the loopback
registry as `library/<distro>:<suite>`, where builds pull it like any registry image. Substitutes
(aliases.py) build on these.

Invariant: idempotent; a suite already in the registry is skipped unless `refresh`. Once per
machine (the registry's storage is in the images cache), once per CI run (the cache starts empty).
An optional suite (Ubuntu's) that cannot be made, asked for by default, is reported and skipped,
never fatal: its aliases fall back to their Debian stand-ins.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .config import ImagesConfig
from .context import lock
from .errors import ImageError
from .registry import registry_for
from .suites import SUITES, Suite
from .tools import Buildah, log_tail, need_tool, system_env

__all__ = ["BootstrapResult", "bootstrap"]

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
    digest: str  # "" when it could not be made (`error`)
    seconds: float  # 0.0 when it was already there
    made: bool
    image: str = ""  # "debian:trixie", "ubuntu:noble"
    error: str | None = None  # an optional suite that could not be made: why (one line)


def _mmdebstrap(suite: Suite, out: Path, log: Path, timeout: float) -> None:
    argv = [need_tool("mmdebstrap"), "--variant=minbase", "--format=tar", "--skip=output/dev"]
    argv.append('--aptopt=Acquire::Retries "3"')
    if suite.distro == "debian":  # Ubuntu's base-files merges /usr itself; its chroot lacks eatmydata
        argv.append(f"--hook-dir={_HOOKS / 'maybe-merged-usr'}")
        if shutil.which("eatmydata"):
            argv.append(f"--hook-dir={_HOOKS / 'eatmydata'}")  # no fsync per unpacked file
    if suite.keyring:
        if not Path(suite.keyring).is_file():
            raise ImageError(
                f"{suite.image}: its archive's keyring {suite.keyring} is missing (bash scripts/install-images.sh)"
            )
        argv.append(f"--keyring={suite.keyring}")
    argv.append(f"--components={','.join(suite.components)}")
    if suite.include:
        argv.append(f"--include={','.join(suite.include)}")
    if suite.user:
        argv.append(f'--customize-hook=chroot "$1" useradd -m -u 1000 -U -s /bin/bash {suite.user}')
    argv += [f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in _EXCLUDE]
    argv.append("--dpkgopt=path-include=/usr/share/doc/*/copyright")
    argv += [suite.name, str(out), *suite.sources()]
    with log.open("wb") as f:
        try:
            proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=system_env())
        except subprocess.TimeoutExpired as e:
            raise ImageError(
                f"mmdebstrap {suite.name}: still running after {timeout:.0f} s\n{log_tail(log)}"
            ) from e
    if proc.returncode != 0:
        raise ImageError(
            f"mmdebstrap {suite.name} failed (exit {proc.returncode}, log {log})\n{log_tail(log)}"
        )


def _host_cas(dest: Path) -> list[str]:
    """Copy this host's own CA certificates (Debian's place for local ones) into dest."""
    names = sorted(p.name for p in HOST_CAS.glob("*.crt")) if HOST_CAS.is_dir() else []
    if names:
        dest.mkdir()
        for name in names:
            shutil.copyfile(HOST_CAS / name, dest / name)
    return names


def _make(suite: Suite, config: ImagesConfig, buildah: Buildah, host_cas: bool) -> None:
    registry = registry_for(config.cache())
    with tempfile.TemporaryDirectory(prefix=f"miles-env-{suite.name}-", dir=config.cache()) as tmp:
        ctx = Path(tmp)
        log = buildah.logs / f"bootstrap-{suite.name}.log"
        _mmdebstrap(suite, ctx / "rootfs.tar", log.with_suffix(".mmdebstrap.log"), config.build_timeout_s)
        cas = _host_cas(ctx / "ca") if host_cas else []
        copy = "COPY ca/ /usr/local/share/ca-certificates/\n" if cas else ""
        (ctx / "Dockerfile").write_text(_BASE_DOCKERFILE.format(cas=copy))
        tag = f"localhost/miles-env/{suite.image}"
        buildah.build(ctx, ctx / "Dockerfile", tag, network="none", timeout=config.build_timeout_s, log=log)
    target = f"docker://{registry.address()}/library/{suite.image}"
    buildah.run(
        ["push", "--tls-verify=false", "--signature-policy", str(buildah.policy), tag, target],
        f"pushing {suite.image} to the loopback registry",
        timeout=600,
    )
    buildah.run(["rmi", tag], f"removing {tag}", timeout=60)


def bootstrap(
    config: ImagesConfig | None = None,
    suites: tuple[str, ...] | None = None,
    *,
    refresh: bool = False,
    host_cas: bool = True,
) -> list[BootstrapResult]:
    """Make and push each suite's base unless the loopback registry has it; one result per suite.
    `suites` None: Debian's, and Ubuntu's where `config.ubuntu()`, an optional one that fails being
    a result with `error`; a suite named explicitly is required."""
    config = config or ImagesConfig()
    default = tuple(n for n, s in SUITES.items() if s.required or config.ubuntu())
    asked = default if suites is None else suites
    unknown = [s for s in asked if s not in SUITES]
    if unknown:
        raise ImageError(f"bootstrap: unknown suite(s) {', '.join(unknown)}; known: {', '.join(SUITES)}")
    registry = registry_for(config.cache())
    buildah = Buildah(config.cache())

    def one(name: str) -> BootstrapResult:
        suite = SUITES[name]
        repo = f"library/{suite.distro}"
        with lock(config.cache() / "locks" / f"bootstrap-{name}.lock"):
            digest = registry.digest(repo, name)
            if digest is not None and not refresh:
                return BootstrapResult(name, digest, 0.0, False, suite.image)
            start = time.monotonic()
            try:
                _make(suite, config, buildah, host_cas)
            except ImageError as e:
                if suites is not None or suite.required:
                    raise
                why = str(e).splitlines()[0]
                return BootstrapResult(name, "", time.monotonic() - start, False, suite.image, why)
            digest = registry.digest(repo, name)
            if digest is None:
                raise ImageError(f"bootstrap: {suite.image} was pushed but the registry does not list it")
            return BootstrapResult(name, digest, time.monotonic() - start, True, suite.image)

    # The suites at once: each mostly waits on the archive and the disk, not on a core.
    with ThreadPoolExecutor(max_workers=max(1, len(asked))) as pool:
        return list(pool.map(one, asked))
