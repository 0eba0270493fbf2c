"""The local builder leaves nothing behind: no mount, no working container, no process.

Whatever a build or an unpack ends with (success, a failing RUN, a RUN past the build timeout,
an unpack that cannot write, the building process SIGKILLed mid-RUN), nothing stays mounted
under buildah's storage (read from /proc/self/mountinfo), no working container stays in it, and
no process of its RUN steps lives on. The success case is the one CI hit: buildah 1.28 keeps,
mounted, the working container of a stage without instructions (`FROM x` alone: every
`SandboxSpec(image=)`; a stage only `COPY --from`'d), which left an overlay mount per run under
the CI's temp dir. And the loopback registry a process started goes with it, SIGKILLed too.

Real buildah, with an image store of this module's own (so what is left in it is exactly what
these builds left, whatever other workers build meanwhile, and their random-keyed root
filesystems stay out of the shared cache): debian:bookworm pulled from the session's loopback
registry, configured as a mirror. Each test builds a context of its own (a key of its own).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles_env.sandboxes.images.config import ImagesConfig
from miles_env.sandboxes.images.errors import ImageError
from miles_env.sandboxes.images.local import LocalImages, _base_name
from miles_env.sandboxes.images.registry import registry_for
from tests.images_support import images_config, write_context
from tests.sandbox_contract import host_pids_with


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory, image_bases: Any) -> Iterator[LocalImages]:
    """A LocalImages over a store of its own, debian:bookworm already in it; removed afterwards
    (~250 MB: the base and the root filesystems these tests unpack)."""
    mirror = f"http://{registry_for(images_config().cache()).address()}"
    cache = tmp_path_factory.mktemp("own-images")
    config = ImagesConfig(cache_dir=str(cache), direct=False, mirrors={"docker.io": mirror})
    images = LocalImages(config)
    try:
        images._ensure_base(images.resolver.resolve("debian:bookworm"))
        yield images
    finally:
        if not _mounts_under(images.buildah.root):  # else left for a person to look at
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(images.buildah.runroot, ignore_errors=True)


def _mounts_under(root: Path) -> set[str]:
    found = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split()[4].replace("\\040", " ")
            if target == str(root) or target.startswith(f"{root}/"):
                found.add(target)
    return found


def _left(images: LocalImages) -> tuple[set[str], dict[str, str]]:
    """What is left in the store: its mounts (the overlay driver's home included) and containers."""
    return _mounts_under(images.buildah.root), images.buildah.containers()


def _context(tmp_path: Path, dockerfile: str) -> Path:
    return write_context(tmp_path / os.urandom(4).hex(), dockerfile, {"nonce.txt": os.urandom(8).hex()})


def test_a_stage_without_instructions_leaves_no_mount(tmp_path: Path, own: LocalImages) -> None:
    only_from = own.build(_context(tmp_path, "FROM debian:bookworm\n"))
    staged = own.build(
        _context(
            tmp_path,
            "FROM debian:bookworm AS empty\nFROM debian:bookworm\nCOPY --from=empty /etc/debian_version /v\n",
        )
    )
    assert only_from.built and staged.built
    assert (only_from.rootfs / "etc/debian_version").read_text() == (staged.rootfs / "v").read_text()
    assert _left(own) == (set(), {})


def test_a_failing_or_timed_out_run_leaves_no_mount_nor_process(tmp_path: Path, own: LocalImages) -> None:
    marker = f"marker-{os.urandom(6).hex()}"
    with pytest.raises(ImageError, match="exit status 7"):
        own.build(_context(tmp_path, f"FROM debian:bookworm\nRUN echo {marker} && exit 7\n"))
    hasty = LocalImages(own.config.model_copy(update={"build_timeout_s": 8}))
    with pytest.raises(ImageError, match="still running after 8 s") as e:
        hasty.build(_context(tmp_path, f"FROM debian:bookworm\nRUN echo {marker} && sleep 600\n"))
    assert marker in str(e.value)  # the RUN step had started: it was stopped, not never begun
    assert host_pids_with(marker) == []  # buildah's SIGTERM took the step down, and its runc
    assert _left(own) == (set(), {})
    assert not list((own.cache / "rootfs").glob("*.tmp*"))


def test_an_unpack_that_fails_leaves_no_mount(tmp_path: Path, own: LocalImages) -> None:
    base = _base_name(own.resolver.resolve("debian:bookworm"))
    with pytest.raises(ImageError, match="unpacking"):
        own.buildah.unpack(base, tmp_path / "no" / "root", 60)
    assert _left(own) == (set(), {})


_BUILD = (
    "import sys; from pathlib import Path; from miles_env.sandboxes.images.local import LocalImages; "
    "from miles_env.sandboxes.images.config import ImagesConfig; "
    "LocalImages(ImagesConfig.model_validate_json(sys.argv[2])).build(Path(sys.argv[1]))"
)


def test_a_build_whose_process_is_killed_leaves_nothing(tmp_path: Path, own: LocalImages) -> None:
    marker = f"marker-{os.urandom(6).hex()}"
    ctx = _context(tmp_path, f"FROM debian:bookworm\nRUN echo {marker} && sleep 600\n")
    (tmp_path / "tmp").mkdir()  # the killed process's own temp files: in ours, not the host's /tmp
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    argv = [sys.executable, "-c", _BUILD, str(ctx), own.config.model_dump_json()]
    builder = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while not host_pids_with(marker) and builder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert host_pids_with(marker), "the RUN step never started"
    finally:
        builder.kill()  # SIGKILL: no handler of ours runs
        builder.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (host_pids_with(marker) or _left(own) != (set(), {})):
        time.sleep(0.2)
    assert host_pids_with(marker) == []
    assert _left(own) == (set(), {})


def test_the_loopback_registry_dies_with_a_killed_process(tmp_path: Path) -> None:
    """A process that started a loopback registry (any lookup does) and is SIGKILLed: the server
    goes too (its watcher), as it does at a normal exit."""
    code = (
        "import sys, time; from pathlib import Path; from miles_env.sandboxes.images.registry import "
        "registry_for; print(registry_for(Path(sys.argv[1])).address(), flush=True); time.sleep(600)"
    )
    owner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().startswith("127.0.0.1:")
        assert host_pids_with(f"{tmp_path}/registry/config-")  # the server, named by its config
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 10
    while host_pids_with(f"{tmp_path}/registry/config-") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert host_pids_with(f"{tmp_path}/registry/config-") == []
