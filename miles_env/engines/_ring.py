"""Consistent hashing of sessions over engine servers: the ring `SGLangEngine` routes by.

Concept: each URL is placed at `_VNODES` points of a 64-bit hash circle; a session id goes to the
first point after its own hash. Adding or removing a URL moves only the sessions of that URL's
points, so every other session keeps its server and that server's KV prefix cache.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

__all__ = ["HashRing"]

_VNODES = 64


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big")


class HashRing:
    """Consistent hashing: adding or removing a URL moves only that URL's sessions."""

    def __init__(self, urls: Sequence[str]) -> None:
        points = sorted((_hash(f"{url}#{i}"), url) for url in urls for i in range(_VNODES))
        self._keys = [p for p, _ in points]
        self._urls = [u for _, u in points]

    def pick(self, key: str) -> str:
        i = bisect.bisect(self._keys, _hash(key)) % len(self._keys)
        return self._urls[i]
