"""What a test session takes back from the host at its end (tests/host_leftovers.py): only the
docker images it built under our names, never one that was there before or that someone else named."""

from __future__ import annotations

from tests.host_leftovers import ours_since


def test_only_new_images_with_only_our_names_are_taken_back():
    before = frozenset({"sha256:old"})
    after = {
        "sha256:old": ["miles-env/hostroot:latest"],  # there before the session: kept
        "sha256:build": ["miles-env/build:abc"],
        "sha256:base": ["127.0.0.1:5000/library/debian:bookworm", "miles-env/base:bookworm"],
        "sha256:localhost": ["localhost:41234/library/debian:trixie"],
        "sha256:dangling": ["<none>:<none>"],
        "sha256:user": ["python:3.12-slim"],  # a user's pull during the session: kept
        "sha256:both": ["miles-env/build:def", "myteam/task:v1"],  # also named by someone else: kept
        "sha256:remote": ["registry.example.com:5000/x:1"],  # a registry that is not loopback: kept
    }
    assert sorted(ours_since(before, after)) == [
        "sha256:base", "sha256:build", "sha256:dangling", "sha256:localhost",
    ]  # fmt: skip
