"""Task images for the tests: one bootstrap and one build per image per pytest session.

The session fixtures in conftest.py (`image_bases`, `images_config`, `bookworm_image`,
`alias_image`) call these. Everything is real: mmdebstrap makes the Debian bases from the
Debian archive, Debian's docker-registry serves them on loopback, buildah (local) and dockerd
(docker) build, RUN steps reach Debian and PyPI. The cache is the ambient MILES_ENV_CACHE's
(CI starts it empty: the bootstrap and each build happen once per run; xdist workers share them
through the cache's locks). `direct=False`: the bases come through the loopback registry even on
a machine that reaches Docker Hub, so the path under test is the same everywhere.

The work starts in a background thread as soon as collection selects a test of test_images.py
(`prewarm`, from conftest's pytest_collection_finish): the bootstrap and the first builds mostly
wait on the Debian archive, PyPI and the disk, so they overlap the tests that run before
test_images.py; its fixtures then wait for what is still running (`prewarmed`).
MILES_ENV_IMAGES_PREWARM=0 turns the overlap off (the fixtures then do the same work in line).

The Dockerfiles have the shapes of public Terminal-Bench tasks: apt-get install and pip install
in RUN, useradd + USER, writes under /opt and /var/log, a here-document, an aliased
`FROM ubuntu:24.04` and `FROM python:3.12-slim`.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from miles_env.sandboxes.images.config import ImagesConfig

__all__ = [
    "BOOKWORM",
    "ALIASES",
    "NOBLE",
    "UBUNTU",
    "ROOT",
    "contexts",
    "docker_ready",
    "images_config",
    "prewarm",
    "prewarmed",
    "write_context",
]

ROOT = Path(__file__).resolve().parents[1]

BOOKWORM = """\
FROM debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends tree && rm -rf /var/lib/apt/lists/*
COPY motd.txt /opt/app/motd.txt
RUN useradd -m -u 1234 -s /bin/bash agent && mkdir -p /var/log/app && chown agent /var/log/app
ENV APP_MODE=test
WORKDIR /opt/app
USER agent
RUN echo "built-as-$(id -un)" > /var/log/app/built.txt
RUN <<EOF
echo "from a here-document" > /var/log/app/heredoc.txt
EOF
"""

ALIASES = """\
FROM ubuntu:24.04 AS ubuntu
RUN id -u ubuntu > /uid.txt && . /etc/os-release && echo "$ID-$VERSION_CODENAME" > /os.txt \
    && for t in pgrep ps chattr; do command -v $t || echo "no $t"; done > /tools.txt
FROM python:3.12-slim
RUN pip install --no-cache-dir --upgrade pip==24.0 && pip --version > /opt/pip-version.txt
RUN pip install --no-cache-dir six==1.17.0
RUN python -c "import six; print(six.__version__)" > /opt/six-version.txt
RUN python --version > /opt/python-version.txt
COPY --from=ubuntu /uid.txt /os.txt /tools.txt /opt/ubuntu/
"""

UBUNTU = """\
FROM ubuntu:24.04
RUN useradd -m -u 1234 -s /bin/bash agent && mkdir -p /opt/task /var/log/task && chown agent /var/log/task \
    && id -u ubuntu > /opt/task/ubuntu-uid.txt
ENV TASK_MODE=docker
WORKDIR /opt/task
USER agent
RUN echo "built-as-$(id -un)" > /var/log/task/built.txt
"""


# ubuntu:24.04 as Ubuntu noble bootstrapped from the Ubuntu archive (`ubuntu_archive`, the default)
NOBLE = """\
FROM ubuntu:24.04
RUN apt-get update && apt-get install -y --no-install-recommends file && rm -rf /var/lib/apt/lists/*
RUN . /etc/os-release && echo "$ID-$VERSION_CODENAME" > /os.txt && id -u ubuntu > /uid.txt \
    && for t in apt-get pgrep chattr file; do command -v $t || echo "no $t"; done > /tools.txt
"""


_PINNED: list[str] = []


def images_config() -> ImagesConfig:
    """The session's images config, its cache pinned at the first call (collection, where the
    prewarm starts): the background builds must not follow a test that points MILES_ENV_CACHE
    elsewhere while they run (test_harness_faults; a fresh machine's non-slow run failed so)."""
    if not _PINNED:
        _PINNED.append(str(ImagesConfig().cache()))
    return ImagesConfig(direct=False, cache_dir=_PINNED[0])


def _noble() -> Any:
    """ubuntu:noble (asked by name: required; a lookup once the session's bootstrap made it), then
    the NOBLE context built on it."""
    from miles_env.sandboxes.images.bootstrap import bootstrap
    from miles_env.sandboxes.images.local import LocalImages

    config = images_config()
    (base,) = bootstrap(config, ("noble",))
    return base, LocalImages(config).build(contexts()["noble"])


def write_context(path: Path, dockerfile: str, files: dict[str, str] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "Dockerfile").write_text(dockerfile)
    for name, text in (files or {}).items():
        (path / name).write_text(text)
    return path


def docker_ready() -> str | None:
    """None when scripts/start-dockerd.sh gives an engine, else its reason."""
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "start-dockerd.sh")], capture_output=True, text=True, timeout=300
    )
    return None if r.returncode == 0 else f"start-dockerd.sh exit {r.returncode}: {r.stderr.strip()[-300:]}"


_STATE: dict[str, Any] = {}
_LOCK = threading.Lock()


def contexts() -> dict[str, Path]:
    """The test images' build contexts, made once per process (fixed contents: stable cache keys)."""
    with _LOCK:
        if "contexts" not in _STATE:
            root = Path(tempfile.mkdtemp(prefix="miles-env-image-contexts-"))
            atexit.register(shutil.rmtree, root, True)
            _STATE["contexts"] = {
                "bookworm": write_context(
                    root / "bookworm", BOOKWORM, {"motd.txt": "hello from the context\n"}
                ),
                "aliases": write_context(root / "aliases", ALIASES),
                "ubuntu": write_context(root / "ubuntu", UBUNTU),
                "noble": write_context(root / "noble", NOBLE),
            }
        return dict(_STATE["contexts"])


def prewarm() -> None:
    """Start the bootstrap, then the local builds of `bookworm` and `aliases`, then noble's bootstrap
    and build, in one background thread."""
    from miles_env.sandboxes.images.bootstrap import bootstrap
    from miles_env.sandboxes.images.local import LocalImages

    ctx = contexts()
    with _LOCK:
        if "futures" in _STATE:
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="images-prewarm")
        futures: dict[str, Future[Any]] = {"bases": pool.submit(bootstrap, images_config())}
        images = futures["images"] = pool.submit(LocalImages, images_config())
        for name in ("bookworm", "aliases"):
            futures[name] = pool.submit(lambda n: images.result().build(ctx[n]), name)
        futures["noble"] = pool.submit(_noble)
        pool.shutdown(wait=False)
        _STATE["futures"] = futures


def prewarmed(name: str) -> Any:
    """`bases`, `images` (the LocalImages builder), `bookworm`, `aliases` or `noble` (its base and image):
    waited for (started if not yet).
    The bases alone, where no image test started the prewarm: a lookup once scripts/test.sh bootstrapped."""
    if name == "bases" and "futures" not in _STATE:
        from miles_env.sandboxes.images.bootstrap import bootstrap

        return bootstrap(images_config())
    prewarm()
    return _STATE["futures"][name].result()
