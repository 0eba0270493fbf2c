"""DiskWatchdog: bounds a container's writable layer where the engine cannot cap it.

Concept: the root of a docker sandbox is always writable (the container's own layer, as
`docker run` gives). Where the engine caps that layer (`storage_opt size`: overlay2 on xfs
with pquota) the cap is hard and this module is not used. Elsewhere (overlay2 on ext4, the
common case) one provider-owned thread polls every watched container's writable-layer size
(`SizeRw` of `docker ps --size`, asked per container by its full id) every `interval_s`; a container whose layer
passes its disk_mb is SIGKILLed and marked, and the sandbox turns its ongoing and every later
exec into one SandboxError (`verdict()`), which ends that episode only.

The bound, stated honestly: this is a soft quota. A sandbox can write past disk_mb for up to
one poll interval plus the time one round of measurements takes (the engine walks each
layer's files), at the host disk's write speed: at 2 s and ~1 GB/s of page cache, up to a
few GB over disk_mb before the kill. A process's single file is still capped at disk_mb by
RLIMIT_FSIZE (sandbox.py's wrapper), so that slack is spread over many files. Use an
engine with overlay2 on xfs+pquota for a hard cap.

Hostile input: the loop lives in our process, outside every container, so nothing inside one
can stop it; an engine error about one container (gone, slow, refused) is caught for that
container alone and the others are still measured and killed; an unmeasurable layer is
counted, and after `max_misses` rounds in a row that container is killed too (a sandbox
must not blind the watchdog to escape it: e.g. a path longer than PATH_MAX in its layer makes
the engine's size walk fail and report -1). The walk costs ~5 us per file in the layer (measured:
3 ms for a fresh sandbox, 250 ms with 50,000 files, on a loaded 2-core host), so millions of
empty files (0 bytes, but host inodes) would slow every round: a measurement that takes over
`max_measure_s` (5 s, about a million files) counts as a miss too. A task's sidecars (sidecars.py) have uncapped
layers on every engine: they are watched too, and a verdict on one ends its sandbox's episode.

Lifecycle: the thread starts with the first watched container and exits when none is left
(or at `close()`, which joins it), so a provider leaks no thread once its sandboxes closed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["DiskWatchdog"]


@dataclass(slots=True)
class _Watched:
    disk_mb: int
    owner: str  # the sandbox whose episode a verdict ends (itself, or a sidecar's sandbox)
    misses: int = 0


class DiskWatchdog:
    """Polls watched containers' writable-layer sizes; kills and marks one that passes its disk_mb."""

    def __init__(
        self, api: Any, interval_s: float = 2.0, max_misses: int = 5, max_measure_s: float = 5.0
    ) -> None:
        self.api = api
        self.interval_s = interval_s
        self.max_misses = max_misses
        self.max_measure_s = max_measure_s  # a slower measurement counts as a miss (see the docstring)
        self._lock = threading.Lock()
        self._watched: dict[str, _Watched] = {}
        self._verdicts: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0  # completed measurement rounds (for tests and bench)
        self.round_s = 0.0  # the last round's duration

    def watch(self, container_id: str, disk_mb: int, owner: str | None = None) -> None:
        """Bound `container_id`'s layer (a full id) at disk_mb; its verdict goes to `owner` (default: itself)."""
        with self._lock:
            self._watched[container_id] = _Watched(disk_mb, owner or container_id)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._loop, name="miles-env-disk-watchdog", daemon=True
                )
                self._thread.start()

    def unwatch(self, container_id: str) -> None:
        with self._lock:
            self._watched.pop(container_id, None)
            self._verdicts.pop(container_id, None)

    def verdict(self, container_id: str) -> str | None:
        """Why the watchdog killed this container, or None while it has not."""
        with self._lock:
            return self._verdicts.get(container_id)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)
        with self._lock:
            self._watched.clear()

    # -- the thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                if not self._watched:
                    self._thread = None  # the next watch() starts a fresh thread
                    return
                round_ = list(self._watched.items())
            start = time.perf_counter()
            for cid, w in round_:
                if self._stop.is_set():
                    return
                self._check(cid, w)
            self.round_s = time.perf_counter() - start
            self.rounds += 1

    def _check(self, cid: str, w: _Watched) -> None:
        start = time.perf_counter()
        try:
            # `docker ps --size` of this one container (the SDK's inspect_container has no size=).
            found = self.api.containers(all=True, size=True, filters={"id": [cid]})
        except Exception:  # noqa: BLE001 - this container's fault only
            found = None
        if found == []:
            self.unwatch(cid)  # removed: nothing left to bound
            return
        size = found[0].get("SizeRw", 0) if found else None  # the list omits a SizeRw of 0; -1 is an error
        slow = time.perf_counter() - start > self.max_measure_s
        if not isinstance(size, int) or size < 0 or slow:
            w.misses += 1
            if w.misses >= self.max_misses:
                why = f"the engine could not measure the root's writable layer {w.misses} times in a row"
                self._kill(cid, f"disk quota unverifiable: {why} (disk_mb={w.disk_mb} MB)")
            return
        w.misses = 0
        if size > w.disk_mb << 20:
            self._kill(
                cid,
                f"disk quota exceeded: the root's writable layer grew past disk_mb={w.disk_mb} MB "
                f"({size >> 20} MB measured)",
            )

    def _kill(self, cid: str, why: str) -> None:
        with self._lock:
            w = self._watched.pop(cid, None)
            if w is None:
                return  # closed meanwhile
            # Before the kill: the owner's ongoing exec sees it when the kill ends it.
            self._verdicts[w.owner] = why if w.owner == cid else f"sidecar {cid[:12]}: {why}"
        for target in dict.fromkeys((cid, w.owner)):
            try:
                self.api.kill(target)
            except Exception:  # noqa: BLE001 - already stopped or gone: it writes nothing more
                pass
