"""`miles-env images`: task images (bootstrap the Debian and Ubuntu bases, build, resolve, the alias table).

`bootstrap` makes debian:bookworm and debian:trixie from the Debian archive and ubuntu:noble and
ubuntu:jammy from the Ubuntu archive (mmdebstrap; Ubuntu's skipped with one line where that
archive is not reachable) and serves them from the loopback registry: once per machine, for
machines that reach no image registry. `build CONTEXT` builds a Docker build context as the local provider does (buildah,
unpacked as a root filesystem) or the docker one does (`--provider docker`). `resolve REF`
says which image a `FROM REF` gets here, and from where. `aliases` lists the built-in
substitutes. Every command reads mirrors and aliases from `--config` (the run config's
`sandbox.images`) and from MILES_ENV_REGISTRY_MIRROR / MILES_ENV_IMAGE_ALIASES.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from miles_env.sandboxes.images.config import ImagesConfig

app = typer.Typer(
    no_args_is_help=True, help="Task images: bootstrap Debian and Ubuntu bases, build, resolve, aliases."
)
_Config = Annotated[
    Path | None, typer.Option("--config", help="run config whose sandbox.images to use (mirrors, aliases)")
]


def _images_config(config: Path | None) -> ImagesConfig:
    from miles_env.sandboxes.images.config import ImagesConfig

    if config is None:
        return ImagesConfig()
    from miles_env.config import load_config

    found = getattr(load_config(config, []).sandbox.config, "images", None)
    return found if isinstance(found, ImagesConfig) else ImagesConfig()


@app.command("bootstrap")
def bootstrap_command(
    suite: Annotated[
        list[str] | None,
        typer.Option("--suite", help="a suite (default: Debian's bookworm, trixie; Ubuntu's noble, jammy)"),
    ] = None,
    refresh: Annotated[bool, typer.Option("--refresh", help="make them again even if present")] = False,
    host_ca: Annotated[
        bool, typer.Option("--host-ca/--no-host-ca", help="put this host's own CAs in the bases")
    ] = True,
    config: _Config = None,
) -> None:
    """Debian and Ubuntu bases from their archives, pushed to the loopback registry (skipped when there)."""
    from miles_env.sandboxes.images.bootstrap import bootstrap

    start = time.monotonic()
    results = bootstrap(
        _images_config(config), tuple(suite) if suite else None, refresh=refresh, host_cas=host_ca
    )
    for r in results:
        if r.error is not None:
            typer.echo(f"{r.image}  skipped (optional; its aliases use their Debian stand-ins): {r.error}")
            continue
        what = f"made in {r.seconds:.0f} s" if r.made else "already there"
        typer.echo(f"{r.image}  {r.digest}  {what}")
    made = sum(r.error is None for r in results)
    typer.echo(f"bootstrap: {made} base(s) in the loopback registry ({time.monotonic() - start:.0f} s)")


@app.command("build")
def build_command(
    context: Annotated[Path, typer.Argument(help="a Docker build context (a directory with a Dockerfile)")],
    provider: Annotated[str, typer.Option(help="local (buildah, unpacked) or docker (dockerd)")] = "local",
    config: _Config = None,
) -> None:
    """Build CONTEXT as the provider would (cached by content: a second build is a lookup)."""
    images = _images_config(config)
    start = time.monotonic()
    if provider == "docker":
        import docker

        from miles_env.sandboxes.docker.build import DockerBuilder

        tag, bases = DockerBuilder(docker.from_env(timeout=int(images.build_timeout_s)), images).build(
            context
        )
        typer.echo(f"image {tag}")
    elif provider == "local":
        from miles_env.sandboxes.images.local import LocalImages

        image = LocalImages(images).build(context)
        bases = image.bases
        typer.echo(f"rootfs {image.rootfs} ({'built' if image.built else 'cached'}, key {image.key[:16]})")
        typer.echo(
            f"config env={dict(image.config.env)} user={image.config.user} workdir={image.config.workdir}"
        )
    else:
        raise typer.BadParameter(f"--provider {provider!r}: local or docker")
    for b in bases:
        typer.echo(f"base {b.requested}: {b.source}, {b.digest[:19]}  {b.note}")
    typer.echo(f"build: {time.monotonic() - start:.1f} s")


@app.command("resolve")
def resolve_command(
    refs: Annotated[list[str], typer.Argument(help="image references, as a FROM line writes them")],
    config: _Config = None,
) -> None:
    """Which image each reference gets here (mirror, its registry, bootstrap, alias), or why none."""
    from miles_env.sandboxes.images.resolve import Resolver
    from miles_env.sandboxes.images.tools import SkopeoProbe

    images = _images_config(config)
    resolver = Resolver(images, SkopeoProbe(images.probe_timeout_s))
    for ref in refs:
        r = resolver.resolve(ref)
        typer.echo(f"{ref}: {r.source} {r.digest}  {r.note}")


@app.command("aliases")
def aliases_command() -> None:
    """The built-in alias table: which bases are substituted offline, by what (the first suite is
    the default; a tag naming another of them, `-bookworm`, gets that one; `else` is the stand-in
    where the default's Ubuntu suite was not bootstrapped)."""
    from miles_env.sandboxes.images.aliases import ALIASES
    from miles_env.sandboxes.images.suites import SUITES

    for a in ALIASES:
        pkgs = " ".join(a.packages) or "-"
        suites = "/".join([SUITES[a.suite].image, *(SUITES[s].image for s, _ in a.suites)])
        if a.fallback is not None:
            suites += f" else {SUITES[a.fallback.suite].image}"
        typer.echo(f"{a.pattern:<60} {suites:<32} {pkgs}  ({a.note})")
