"""Task images, built for real: bootstrap -> loopback registry -> buildah (local) and dockerd (docker).

Each image is built once per session (conftest.py's fixtures, tests/images_support.py): a
`FROM debian:bookworm` pulled through the loopback registry, with apt-get install, useradd +
USER, writes under /opt and /var/log and a here-document; aliased `FROM ubuntu:24.04` and
`FROM python:3.12-slim` with pip install. The tests check the files and the ImageConfig on both
builders (docker: the ubuntu:24.04 one, a small build), that a second build is the cache (by its key, not its time), that concurrent builds
of one context are one build, that a failing RUN shows the log's tail, and the mirror and your
own aliases. No mocks: real mmdebstrap, docker-registry, buildah, dockerd, Debian and PyPI.
The bootstrap and the first builds are this file's cost (once per CI run, started in the
background at collection: images_support.prewarm); every later use is a cache lookup.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from miles_env.sandboxes.images.config import ImagesConfig
from miles_env.sandboxes.images.errors import ImageError
from miles_env.sandboxes.images.local import LocalImages
from miles_env.sandboxes.images.registry import registry_for
from miles_env.sandboxes.images.resolve import Resolver
from miles_env.sandboxes.images.tools import _MARK, Buildah, SkopeoProbe, _build_args
from miles_env.types import SandboxSpec
from tests.images_support import docker_ready, images_config, write_context

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _owner(path: Path) -> int:
    return os.lstat(path).st_uid


def test_bootstrap_serves_debian_and_ubuntu_through_the_registry(image_bases: Any) -> None:
    assert [(r.image, r.error) for r in image_bases] == [
        ("debian:bookworm", None),
        ("debian:trixie", None),
        ("ubuntu:noble", None),  # this machine reaches the Ubuntu archive (else: skipped, with why)
        ("ubuntu:jammy", None),
    ]
    registry = registry_for(images_config().cache())
    for r in image_bases:
        assert registry.digest(f"library/{r.image.split(':')[0]}", r.suite) == r.digest
    resolved = Resolver(images_config(), SkopeoProbe(20)).resolve("debian:bookworm")
    assert resolved.source == "bootstrap" and resolved.ref.startswith("127.0.0.1:") and resolved.insecure
    assert resolved.digest == image_bases[0].digest and resolved.substituted_from is None


def test_local_build_has_the_images_files_and_config(bookworm_image: Any, image_bases: Any) -> None:
    root = bookworm_image.rootfs
    assert (root / "usr/bin/tree").is_file()  # apt-get install, from the Debian archive
    assert (root / "opt/app/motd.txt").read_text() == "hello from the context\n"
    assert (root / "var/log/app/built.txt").read_text() == "built-as-agent\n"  # RUN as USER agent
    assert (root / "var/log/app/heredoc.txt").read_text() == "from a here-document\n"
    assert _owner(root / "var/log/app/built.txt") == 1234 and _owner(root / "usr/bin/tree") == 0
    assert "agent:x:1234:1234::/home/agent:/bin/bash" in (root / "etc/passwd").read_text()
    assert not any((root / "dev").iterdir())  # a sandbox brings its own /dev
    cfg = bookworm_image.config
    assert dict(cfg.env) == {"PATH": DEFAULT_PATH, "APP_MODE": "test"}
    assert (cfg.user, cfg.workdir) == ("agent", "/opt/app")
    assert [b.source for b in bookworm_image.bases] == ["bootstrap"]
    assert bookworm_image.bases[0].digest == image_bases[0].digest


def test_a_second_build_is_the_cache(bookworm_image: Any, image_contexts: dict[str, Path]) -> None:
    """A new builder (as a new process would have) finds the key: nothing is built again."""
    again = LocalImages(images_config()).build(image_contexts["bookworm"])
    assert (again.key, again.rootfs, again.built) == (bookworm_image.key, bookworm_image.rootfs, False)
    assert again.config == bookworm_image.config


def test_the_key_follows_the_context(tmp_path: Path, local_images: LocalImages) -> None:
    from miles_env.sandboxes.images.context import plan_build
    from tests.images_support import BOOKWORM

    def key(motd: str) -> str:
        ctx = write_context(tmp_path / motd, BOOKWORM, {"motd.txt": motd})
        plan = plan_build(ctx, local_images.resolver, local_images.builder_id, lambda b: "x")
        return plan.key

    assert key("a") == key("a") and key("a") != key("b")


def test_the_key_does_not_see_the_registry_port(alias_image: Any, image_contexts: dict[str, Path]) -> None:
    """Another process's loopback registry listens elsewhere: the same context is the same key."""
    from miles_env.sandboxes.images.context import plan_build
    from miles_env.sandboxes.images.registry import LoopbackRegistry

    other = LoopbackRegistry(images_config().cache() / "registry")
    try:
        resolver = Resolver(images_config(), SkopeoProbe(20), registry=other)
        plan = plan_build(image_contexts["aliases"], resolver, LocalImages.builder_id, lambda b: "x")
        assert other.address() != registry_for(images_config().cache()).address()
        assert plan.key == alias_image.key
    finally:
        other.stop()


def test_concurrent_builds_of_one_context_are_one_build(tmp_path: Path, local_images: LocalImages) -> None:
    ctx = write_context(tmp_path / "c", f"FROM debian:bookworm\nRUN echo {os.urandom(6).hex()} > /opt/once\n")
    results: list[Any] = []

    def build() -> None:
        try:
            results.append(LocalImages(images_config()).build(ctx))
        except Exception as e:  # noqa: BLE001 - shown by the assertion below
            results.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not [r for r in results if isinstance(r, Exception)], results
    assert sorted(r.built for r in results) == [False, False, True]
    assert (
        len({r.key for r in results}) == 1
        and len({(r.rootfs / "opt/once").read_text() for r in results}) == 1
    )


def test_a_build_under_a_narrow_path_still_finds_the_system_tools(
    tmp_path: Path, local_images: LocalImages, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A RUN step's network (buildah's CNI bridge) needs iptables from /usr/sbin, which a non-root
    login's PATH lacks, and a test's narrowed PATH lacked while this worker's background build ran
    (a fresh-machine run: `failed to locate iptables`): the kept tools get the system's folders."""
    monkeypatch.setenv("PATH", str(tmp_path))
    ctx = write_context(tmp_path / "p", f"FROM debian:bookworm\nRUN echo {os.urandom(6).hex()} > /made\n")
    assert (local_images.build(ctx).rootfs / "made").is_file()


def test_a_failing_run_shows_the_log_tail(
    tmp_path: Path, local_images: LocalImages, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = write_context(
        tmp_path / "f", "FROM debian:bookworm\nRUN echo marker-before-the-failure && exit 3\n"
    )
    # The storage is shared with the other workers' builds (and this worker's prewarm), whose
    # containers come and go meanwhile (CI: a set difference of all containers failed on one):
    # this build's own containers are the ones carrying its nonce
    nonces: list[str] = []
    remove_own = Buildah._remove_own

    def _recorded(self: Buildah, before: set[str], nonce: str) -> None:
        nonces.append(nonce)
        remove_own(self, before, nonce)

    monkeypatch.setattr(Buildah, "_remove_own", _recorded)
    with pytest.raises(ImageError) as e:
        local_images.build(ctx)
    (nonce,) = nonces
    buildah = local_images.buildah
    own = [c for c in buildah.containers() if _build_args(buildah.root, c).get(_MARK) == nonce]
    assert not own  # its working container (and mount) removed
    assert str(e.value).startswith(f"building {ctx / 'Dockerfile'} failed")
    msg = str(e.value)
    # in the order printed (the builder's stdout and stderr in one log): the step's own output,
    # then the builder's verdict, which ends the message
    assert 0 <= msg.find("marker-before-the-failure") < msg.find("exit status 3")
    assert "exit status 3" in msg.splitlines()[-1]
    assert not list((local_images.cache / "rootfs").glob("*.tmp*"))


def test_aliased_bases_are_substituted_printed_and_recorded(
    alias_image: Any,
    local_images: LocalImages,
    image_contexts: dict[str, Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = alias_image.rootfs
    assert (root / "opt/six-version.txt").read_text() == "1.17.0\n"  # pip install from PyPI in RUN
    # pip is PyPI's under /usr/local, as in python:* images: upgradable (Debian's has no RECORD)
    assert (root / "opt/pip-version.txt").read_text().startswith("pip 24.0 from /usr/local/lib/python3")
    assert os.readlink(root / "usr/local/bin/python") == "/usr/bin/python3"
    assert (
        (root / "opt/python-version.txt").read_text().startswith("Python 3.12.")
    )  # noble's, as python:3.12 (ubuntu_archive, the default; off: trixie's 3.13)
    assert (root / "opt/ubuntu/uid.txt").read_text() == "1000\n"  # the image's user `ubuntu`
    assert (root / "opt/ubuntu/os.txt").read_text() == "ubuntu-noble\n"  # rebuilt from Ubuntu's archive
    # the tools the real ubuntu:24.04 has that a minbase lacks (suites.py)
    assert (root / "opt/ubuntu/tools.txt").read_text().split() == [
        "/usr/bin/pgrep",
        "/usr/bin/ps",
        "/usr/bin/chattr",
    ]
    assert alias_image.substituted_from == ("ubuntu:24.04", "python:3.12-slim")
    meta = alias_image.metadata()["bases"]
    assert [m["source"] for m in meta] == ["substitute", "substitute"] and "offline only" in meta[0]["note"]
    with caplog.at_level(logging.WARNING):
        local_images.build(image_contexts["aliases"])  # cached: printed all the same
    assert sum("substituted (offline only)" in r.getMessage() for r in caplog.records) == 2


def test_ubuntu_from_its_own_archive_is_the_real_distribution(image_bases: Any) -> None:
    """ubuntu:24.04 is Ubuntu noble made from the Ubuntu archive (signed by its keyring): its os-release,
    apt reaching that archive in RUN (`file`), the image's tools and its user `ubuntu`; every use
    recorded as a substitute. With `ubuntu_archive` off, the Debian stand-in (test_images_aliases)."""
    from tests.images_support import prewarmed

    base, image = prewarmed("noble")
    assert (base.image, base.error) == ("ubuntu:noble", None)
    assert registry_for(images_config().cache()).digest("library/ubuntu", "noble") == base.digest
    root = image.rootfs
    assert (root / "os.txt").read_text() == "ubuntu-noble\n" and (root / "uid.txt").read_text() == "1000\n"
    assert (root / "tools.txt").read_text().split() == [
        "/usr/bin/apt-get",
        "/usr/bin/pgrep",
        "/usr/bin/chattr",
        "/usr/bin/file",
    ]
    (meta,) = image.metadata()["bases"]
    assert meta["source"] == "substitute" and "built on ubuntu:noble" in meta["note"]
    assert meta["digest"] == base.digest


def test_a_mirror_and_your_own_aliases(image_bases: Any) -> None:
    """Any OCI registry is a mirror (here the loopback one itself); your alias may name a pinned base."""
    addr = registry_for(images_config().cache()).address()
    pinned = "python:3.12-slim@sha256:" + "d" * 64
    cfg = ImagesConfig(
        direct=False, mirrors={"docker.io": f"http://{addr}"}, aliases={pinned: "debian:trixie"}
    )
    resolver = Resolver(cfg, SkopeoProbe(20))
    via_mirror = resolver.resolve("debian:bookworm")
    assert (via_mirror.source, via_mirror.digest) == ("mirror", image_bases[0].digest)
    mine = resolver.resolve(pinned)
    assert (mine.source, mine.substituted_from, mine.digest) == ("alias", pinned, image_bases[1].digest)


# -- the local provider: the image is the sandbox's root ------------------------------------------------


def test_local_provider_runs_in_the_built_image(bookworm_image: Any, image_contexts: dict[str, Path]) -> None:
    from miles_env.sandboxes.local import LocalSandboxProvider
    from miles_env.sandboxes.local.config import LocalSandboxConfig

    async def main() -> str:
        provider = LocalSandboxProvider(LocalSandboxConfig(images=images_config()))
        try:
            spec = SandboxSpec(build=str(image_contexts["bookworm"]), workdir="/home/agent")
            async with await provider.create(spec) as sb:
                assert sb.image_config == bookworm_image.config  # for the execs (ENV, USER, WORKDIR)
                assert sb.image_bases == bookworm_image.bases  # for the episode's metadata
                r = await sb.exec(
                    "cat /var/log/app/built.txt /opt/app/motd.txt; tree --version; . /etc/os-release; echo $VERSION_CODENAME"
                )
                assert r.ok, r
                return r.stdout
        finally:
            await provider.aclose()

    out = anyio.run(main)
    assert out.startswith("built-as-agent\nhello from the context\ntree v2") and out.endswith("bookworm\n")


def test_local_provider_runs_an_image_by_reference(image_bases: Any) -> None:
    """SandboxSpec.image on local: the image resolved and pulled (here from the loopback registry), unpacked."""
    from miles_env.sandboxes.local import LocalSandboxProvider
    from miles_env.sandboxes.local.config import LocalSandboxConfig

    async def main() -> tuple[str, Any]:
        provider = LocalSandboxProvider(LocalSandboxConfig(images=images_config()))
        try:
            async with await provider.create(SandboxSpec(image="debian:trixie", workdir="/root")) as sb:
                r = await sb.exec(". /etc/os-release && echo $VERSION_CODENAME")
                return r.stdout, sb.image_bases
        finally:
            await provider.aclose()

    out, bases = anyio.run(main)
    assert out == "trixie\n" and [b.source for b in bases] == ["bootstrap"]


# -- the docker provider: dockerd builds the same Dockerfiles -------------------------------------------


@pytest.fixture(scope="module")
def docker_client() -> Any:
    reason = docker_ready()
    if reason is not None:
        pytest.skip(f"docker engine unavailable: {reason}")
    import docker

    return docker.from_env(timeout=900)


def test_docker_provider_builds_with_an_aliased_base(
    docker_client: Any, image_bases: Any, image_contexts: dict[str, Path]
) -> None:
    """dockerd builds the task's Dockerfile: the substitute built on debian:trixie pulled from the
    loopback registry, useradd + USER, writes under /opt and /var/log; then the container runs it."""
    from miles_env.sandboxes.docker import DockerSandboxConfig, DockerSandboxProvider

    async def main() -> tuple[str, str, Any]:
        provider = DockerSandboxProvider(DockerSandboxConfig(images=images_config()))
        async with await provider.create(SandboxSpec(build=str(image_contexts["ubuntu"]))) as sb:
            r = await sb.exec("cat /opt/task/ubuntu-uid.txt /var/log/task/built.txt")
            (tag,) = provider.built_bases
            return r.stdout, tag, sb.image_bases

    out, tag, bases = anyio.run(main)
    assert out == "1000\nbuilt-as-agent\n"
    config = docker_client.images.get(tag).attrs["Config"]
    assert (config["User"], config["WorkingDir"]) == ("agent", "/opt/task")
    assert config["Env"] == [f"PATH={DEFAULT_PATH}", "TASK_MODE=docker"]
    assert bases[0].substituted_from == "ubuntu:24.04" and bases[0].source == "substitute"
    from miles_env.sandboxes.docker.build import DockerBuilder

    again, _ = DockerBuilder(docker_client, images_config()).build(image_contexts["ubuntu"])
    assert again == tag  # the cache: the engine has the key's tag

    async def by_reference() -> tuple[str, Any]:
        provider = DockerSandboxProvider(DockerSandboxConfig(images=images_config()))
        async with await provider.create(SandboxSpec(image="ubuntu:24.04")) as sb:
            return (await sb.exec("id -u ubuntu")).stdout, sb.image_bases

    uid, bases = anyio.run(by_reference)  # SandboxSpec.image the engine lacks: resolved the same way
    assert uid == "1000\n" and bases[0].substituted_from == "ubuntu:24.04"
