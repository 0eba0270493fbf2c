"""The local builder leaves nothing behind: no mount, no working container, no process.

Whatever a build or an unpack ends with (success, a failing RUN, a RUN past the build timeout,
an unpack that cannot write), nothing stays mounted under buildah's storage (read from
/proc/self/mountinfo), no working container of it stays in the storage, and no process of its
RUN steps lives on. The success case is the one CI hit: buildah 1.28 keeps, mounted, the
working container of a stage without instructions (`FROM x` alone: every `SandboxSpec(image=)`;
a stage only `COPY --from`'d), which left one overlay mount per run under the CI's temp dir.
The last test SIGKILLs the process that builds, mid-RUN: buildah still cleans up (it gets SIGTERM
when we die). Real buildah over the session's bootstrapped bases; each test builds a context of its own (a
random file in it: a key of its own, so a real build every time).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from miles_env.sandboxes.images.config import ImagesConfig
from miles_env.sandboxes.images.errors import ImageError
from miles_env.sandboxes.images.local import LocalImages
from tests.images_support import write_context
from tests.sandbox_contract import host_pids_with


def _mounts_under(root: Path) -> set[str]:
    """Mount points at or below `root`, but the overlay driver's own home (c/storage binds it onto
    itself for the length of each buildah call, any process's)."""
    found = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split()[4].replace("\\040", " ")
            if (target == str(root) or target.startswith(f"{root}/")) and target != f"{root}/overlay":
                found.add(target)
    return found


def _containers_from(images: LocalImages, base: str) -> set[str]:
    """The storage's working containers made from `base` (a concurrent build's from another base
    are none of ours)."""
    image_id = images.buildah.inspect(base)["FromImageID"]
    return {cid for cid, image in images.buildah.containers().items() if image == image_id}


def _context(tmp_path: Path, dockerfile: str) -> Path:
    return write_context(tmp_path / os.urandom(4).hex(), dockerfile, {"nonce.txt": os.urandom(8).hex()})


def _bookworm_base(images: LocalImages) -> str:
    from miles_env.sandboxes.images.local import _base_name

    return _base_name(images.resolver.resolve("debian:bookworm"))


def test_a_stage_without_instructions_leaves_no_mount(
    tmp_path: Path, local_images: LocalImages, bookworm_image: Any
) -> None:
    base = _bookworm_base(local_images)
    mounts, containers = _mounts_under(local_images.buildah.root), _containers_from(local_images, base)
    only_from = local_images.build(_context(tmp_path, "FROM debian:bookworm\n"))
    staged = local_images.build(
        _context(
            tmp_path,
            "FROM debian:bookworm AS empty\nFROM debian:bookworm\nCOPY --from=empty /etc/debian_version /v\n",
        )
    )
    assert only_from.built and staged.built and (staged.rootfs / "v").is_file()
    assert (only_from.rootfs / "etc/debian_version").read_text() == (staged.rootfs / "v").read_text()
    assert _mounts_under(local_images.buildah.root) == mounts
    assert _containers_from(local_images, base) == containers


def test_a_failing_or_timed_out_run_leaves_no_mount_nor_process(
    tmp_path: Path, local_images: LocalImages, bookworm_image: Any
) -> None:
    base = _bookworm_base(local_images)
    mounts, containers = _mounts_under(local_images.buildah.root), _containers_from(local_images, base)
    marker = f"marker-{os.urandom(6).hex()}"
    with pytest.raises(ImageError, match="exit status 7"):
        local_images.build(_context(tmp_path, f"FROM debian:bookworm\nRUN echo {marker} && exit 7\n"))
    hasty = LocalImages(ImagesConfig(direct=False, build_timeout_s=8))
    with pytest.raises(ImageError, match="still running after 8 s") as e:
        hasty.build(_context(tmp_path, f"FROM debian:bookworm\nRUN echo {marker} && sleep 600\n"))
    assert marker in str(e.value)  # the RUN step had started: it was stopped, not never begun
    assert host_pids_with(marker) == []  # buildah's SIGTERM took the step down, and its runc
    assert _mounts_under(local_images.buildah.root) == mounts
    assert _containers_from(local_images, base) == containers
    assert not list((local_images.cache / "rootfs").glob("*.tmp*"))


def test_an_unpack_that_fails_leaves_no_mount(
    tmp_path: Path, local_images: LocalImages, bookworm_image: Any
) -> None:
    before = _mounts_under(local_images.buildah.root)
    with pytest.raises(ImageError, match="unpacking"):
        local_images.buildah.unpack(_bookworm_base(local_images), tmp_path / "no" / "root", 60)
    assert _mounts_under(local_images.buildah.root) == before
    names = local_images.buildah.run(["containers", "--format", "{{.ContainerName}}"], "listing", timeout=60)
    assert "miles-env-unpack-" not in names


_BUILD = (
    "import sys; from pathlib import Path; from miles_env.sandboxes.images.local import LocalImages; "
    "from miles_env.sandboxes.images.config import ImagesConfig; "
    "LocalImages(ImagesConfig(direct=False)).build(Path(sys.argv[1]))"
)


def test_a_build_whose_process_is_killed_leaves_nothing(
    tmp_path: Path, local_images: LocalImages, bookworm_image: Any
) -> None:
    base = _bookworm_base(local_images)
    mounts, containers = _mounts_under(local_images.buildah.root), _containers_from(local_images, base)
    marker = f"marker-{os.urandom(6).hex()}"
    ctx = _context(tmp_path, f"FROM debian:bookworm\nRUN echo {marker} && sleep 600\n")
    (tmp_path / "tmp").mkdir()  # the killed process's own temp files: in ours, not the host's /tmp
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    builder = subprocess.Popen([sys.executable, "-c", _BUILD, str(ctx)], stdout=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while not host_pids_with(marker) and builder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert host_pids_with(marker), "the RUN step never started"
    finally:
        builder.kill()  # SIGKILL: no handler of ours runs
        builder.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        host_pids_with(marker) or _containers_from(local_images, base) != containers
    ):
        time.sleep(0.2)
    assert host_pids_with(marker) == []
    assert _containers_from(local_images, base) == containers
    assert _mounts_under(local_images.buildah.root) == mounts
