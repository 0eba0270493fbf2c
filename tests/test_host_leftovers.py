"""What a test session takes back from the host at its end (tests/host_leftovers.py): only the
docker images it built under its own names, never one that was there before, that someone else
named, or that a user's run built meanwhile under the hub's default names."""

from __future__ import annotations

import pytest

from miles_env.sandboxes.images.config import ImagesConfig
from tests.host_leftovers import NAMESPACE, ours_since


def test_only_new_images_with_only_our_names_are_taken_back():
    before = frozenset({"sha256:old"})
    after = {
        "sha256:old": ["miles-env-test/build:0"],  # there before the session: kept
        "sha256:build": ["miles-env-test/build:abc"],
        "sha256:base": ["127.0.0.1:5000/library/debian:bookworm", "miles-env-test/base:bookworm"],
        "sha256:a-users-run": ["miles-env/build:abc"],  # built by a user's run meanwhile: kept
        "sha256:its-base": ["localhost:5000/library/debian:trixie", "miles-env/base:trixie"],  # kept
        "sha256:localhost": ["localhost:41234/library/debian:trixie"],
        "sha256:dangling": ["<none>:<none>"],
        "sha256:user": ["python:3.12-slim"],  # a user's pull during the session: kept
        "sha256:both": ["miles-env-test/build:def", "myteam/task:v1"],  # also named by someone else: kept
        "sha256:remote": ["registry.example.com:5000/x:1"],  # a registry that is not loopback: kept
    }
    assert sorted(ours_since(before, after)) == [
        "sha256:base", "sha256:build", "sha256:dangling", "sha256:localhost",
    ]  # fmt: skip


def test_the_session_builds_under_its_own_namespace(monkeypatch: pytest.MonkeyPatch):
    # set by the controller before the workers start (conftest), so every build here is named apart
    assert ImagesConfig().repo("build") == f"{NAMESPACE}/build"
    assert ImagesConfig(namespace="team-a").repo("base") == "team-a/base"  # the config's own wins
    monkeypatch.delenv("MILES_ENV_IMAGE_NAMESPACE")
    assert ImagesConfig().repo("build") == "miles-env/build"  # a user's run: the default
