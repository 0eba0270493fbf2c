"""What a test session leaves on the host, taken back when it ends: the docker images it built.

Temporary directories go by themselves (pyproject's `tmp_path_retention_policy = "failed"`:
a passing test's `tmp_path` is removed at its teardown). Docker images do not: every session
that builds task images (tests/images_support.py, the docker provider's tests) leaves ~2 GB of
`miles-env/build:*`, `miles-env/base:*` and bases pulled from the loopback registry
(`127.0.0.1:<port>/library/debian:*`). CI runs on the same machine every time, so those piled up
until a run died of `No space left on device` (stop 35: 99 images, 21.6 GB). The controller takes a
snapshot of the image ids at session start and, at the end, removes the images that are new and
that are ours by name (every tag under the session's namespace, `miles-env-test/`, or a loopback
registry, or untagged): an image a user pulled or built meanwhile under another name is never
touched. The session builds under its own namespace (`MILES_ENV_IMAGE_NAMESPACE`, set by the
controller before the workers start; sandboxes/images/config.py) so that a user's run on the same
engine, whose images are `miles-env/*`, never loses one to this: sharing `miles-env/` once removed
a concurrent benchmark's task image and the base it was building on.
"""

from __future__ import annotations

import re
import shutil
import subprocess

NAMESPACE = "miles-env-test"  # the session's docker repository prefix (MILES_ENV_IMAGE_NAMESPACE)


def _ours(namespace: str) -> re.Pattern[str]:
    return re.compile(rf"^({re.escape(namespace)}/|127\.0\.0\.1:\d+/|localhost:\d+/|<none>:<none>$)")


def _docker(*args: str) -> str | None:
    if shutil.which("docker") is None:
        return None
    try:
        r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def _images() -> dict[str, list[str]] | None:
    """Image id -> its repo:tag names, or None when no docker daemon answers."""
    out = _docker("image", "ls", "--no-trunc", "--format", "{{.ID}} {{.Repository}}:{{.Tag}}")
    if out is None:
        return None
    images: dict[str, list[str]] = {}
    for line in out.splitlines():
        image_id, _, name = line.partition(" ")
        images.setdefault(image_id, []).append(name)
    return images


def snapshot() -> frozenset[str] | None:
    """The ids of the images present now (None: no docker, nothing will be removed)."""
    images = _images()
    return None if images is None else frozenset(images)


def ours_since(before: frozenset[str], after: dict[str, list[str]], namespace: str = NAMESPACE) -> list[str]:
    """The ids in `after` that are not in `before` and whose every name is ours."""
    ours = _ours(namespace)
    return [i for i, names in after.items() if i not in before and all(ours.match(n) for n in names)]


def remove_new(before: frozenset[str] | None, namespace: str = NAMESPACE) -> int:
    """Remove the images that are not in `before` and are ours by every name; return how many."""
    after = _images() if before is not None else None
    if after is None or before is None:
        return 0
    new = ours_since(before, after, namespace)
    removed: set[str] = set()
    for _ in range(2):  # a second pass for a base whose child image went in the first
        for image_id in new:
            if image_id not in removed and _docker("image", "rm", "--force", image_id) is not None:
                removed.add(image_id)
    return len(removed)
