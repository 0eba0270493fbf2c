"""Replay queue backends side by side: SQLite (embedded) against Redis (shared), same episodes.

Run through `python bench/bench_queue.py --backends` (its episodes: 4k tokens by default). Each
round runs every backend once on a fresh store, in turn, so all see the same machine load; the
figure per backend is the median over rounds, the ratio is against SQLite synchronous=NORMAL
(the embedded default). The workload is the trainer's: `producers` threads put every episode
(back-pressure off), then one consumer takes 4 groups at a time and acks each batch.

Redis is Debian's redis-server started here (tests/redis_server.py: free port, temp dir on the
same disk as the SQLite file, AOF on, no RDB) and reached over loopback TCP, so its figures
include a round trip per call that SQLite, in-process, does not pay.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from miles_env.queue.contract import ReplayQueue
from miles_env.queue.redis import RedisReplayQueue
from miles_env.queue.sqlite import SqliteReplayQueue
from miles_env.types import Episode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_server import RedisServer  # noqa: E402

__all__ = ["compare"]

Opener = Callable[[int], ReplayQueue]


@contextmanager
def _sqlite(synchronous: str) -> Iterator[tuple[Opener, Callable[[], float]]]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "queue.db"

        def size() -> float:
            return sum(p.stat().st_size for p in Path(d).iterdir())

        yield (
            lambda gs: SqliteReplayQueue(
                path, group_size=gs, max_pending_groups=10**6, synchronous=synchronous
            ),
            size,
        )


@contextmanager
def _redis(appendfsync: str) -> Iterator[tuple[Opener, Callable[[], float]]]:
    with tempfile.TemporaryDirectory() as d, RedisServer(Path(d), appendfsync=appendfsync) as srv:
        admin = redis.Redis.from_url(srv.url)

        def size() -> float:  # the server's memory: Redis holds the queue in RAM (AOF on disk too)
            return float(admin.info("memory")["used_memory"])

        yield (
            lambda gs: RedisReplayQueue(srv.url, prefix="bench", group_size=gs, max_pending_groups=10**6),
            size,
        )
        admin.close()


BACKENDS = {
    "sqlite NORMAL": lambda: _sqlite("NORMAL"),
    "sqlite FULL": lambda: _sqlite("FULL"),
    "redis everysec": lambda: _redis("everysec"),
    "redis always": lambda: _redis("always"),
}


def _run(name: str, episodes: list[Episode], group_size: int, producers: int) -> dict[str, float]:
    with BACKENDS[name]() as (open_queue, size):
        q = open_queue(group_size)
        shards = [episodes[k::producers] for k in range(producers)]

        def put_all(shard: list[Episode]) -> None:
            for ep in shard:
                q.put(ep, block=False)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=put_all, args=(s,)) for s in shards]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t1 = time.perf_counter()
        stored = size()
        got = 0
        while leases := q.take(4):
            got += sum(len(lease.episodes) for lease in leases)
            q.ack(leases)
        t2 = time.perf_counter()
        assert got == len(episodes), (name, got)
        q.close()
    n = len(episodes)
    return {
        "put": n / (t1 - t0),
        "take+ack": n / (t2 - t1),
        "total": n / (t2 - t0),
        "kb_per_ep": stored / n / 1024,
    }


def compare(episodes: list[Episode], group_size: int, *, rounds: int, producers: int) -> None:
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in BACKENDS}
    for _ in range(rounds):
        for name in BACKENDS:
            runs[name].append(_run(name, episodes, group_size, producers))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    base = med["sqlite NORMAL"]
    tokens = len(episodes[0].samples[0].token_ids)
    print(
        f"{len(episodes)} episodes x {tokens} tokens, group_size {group_size}, {producers} producer(s), "
        f"median of {rounds} alternating rounds"
    )
    print(
        f"{'backend':16} {'put ep/s':>9} {'take+ack ep/s':>14} {'total ep/s':>11} {'vs sqlite':>10} "
        f"{'KiB/ep':>7}  (sqlite: file on disk; redis: server RAM before the acks)"
    )
    for name, r in med.items():
        print(
            f"{name:16} {r['put']:9.0f} {r['take+ack']:14.0f} {r['total']:11.0f} "
            f"{r['total'] / base['total']:9.2f}x {r['kb_per_ep']:7.1f}"
        )
