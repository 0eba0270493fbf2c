"""RedisReplayQueue: the queue contract on Redis, a kill -9 of redis-server mid-run, the backend config.

Every test runs against a real redis-server (Debian's, scripts/install-redis.sh) that the tests start
themselves on a free port in a temp dir with AOF on (tests/redis_server.py), never the system service.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from pydantic import TypeAdapter, ValidationError
from queue_contract import QueueContract, fill, make_episode
from redis_server import RedisServer

from miles_env.queue.config import QueueConfig, RedisQueueConfig, SqliteQueueConfig, build_queue
from miles_env.queue.contract import QueueError, ReplayQueue
from miles_env.queue.redis import RedisReplayQueue
from miles_env.queue.sqlite import SqliteReplayQueue


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


class RedisBackend:
    """One queue (one key prefix) on a running server."""

    def __init__(self, url: str, *, retry_s: float = 5.0) -> None:
        self.url = url
        self.prefix = f"test-{uuid.uuid4().hex[:8]}"
        self.retry_s = retry_s

    def open(self, *, group_size: int | None = None, max_pending_groups: int = 64) -> RedisReplayQueue:
        return RedisReplayQueue(
            self.url,
            prefix=self.prefix,
            group_size=group_size,
            max_pending_groups=max_pending_groups,
            retry_s=self.retry_s,
        )

    def corrupt(self, episode_id: str, offset: int) -> None:
        raw = redis.Redis.from_url(self.url)
        key = f"{{{self.prefix}}}:e:{episode_id}"
        bad = bytearray(raw.hget(key, "arrays"))  # type: ignore[arg-type]
        bad[offset] ^= 0x01
        raw.hset(key, "arrays", bytes(bad))
        raw.close()


class TestRedisContract(QueueContract):
    @pytest.fixture
    def backend(self, server: RedisServer) -> RedisBackend:
        return RedisBackend(server.url)


# -- faults: kill -9 of redis-server ---------------------------------------------------------------


@pytest.mark.parametrize("appendfsync", ["always", "everysec"])
def test_kill9_redis_loses_nothing_put_or_acked(tmp_path: Path, appendfsync: str) -> None:
    """Producers and a trainer hammer the queue; redis-server is SIGKILLed mid-run and restarted from
    its AOF. Every put that returned is still stored, every ack that returned is still acked (never
    returned again), the leases in flight come back through recover, and nothing is returned twice."""
    srv = RedisServer(tmp_path / "redis", appendfsync=appendfsync).start()
    try:
        backend = RedisBackend(srv.url, retry_s=0)  # fail fast while the server is down
        q = backend.open(group_size=2, max_pending_groups=10**6)
        put_ok: list[str] = []
        acked_groups: set[str] = set()
        trained: list[str] = []
        stop = threading.Event()

        def produce(k: int) -> None:
            for g in itertools.count():
                for i in range(2):
                    if stop.is_set():
                        return
                    eid = f"p{k}-g{g}-{i}"
                    try:
                        if q.put(make_episode(eid, f"p{k}-g{g}", n_tokens=512), block=False):
                            put_ok.append(eid)
                    except QueueError:
                        return  # the server died under this put: its outcome is unknown

        def train() -> None:
            while not stop.is_set():
                try:
                    for lease in q.take(2, lease_s=600):
                        trained.extend(lease.episode_ids)
                        if len(trained) % 3:  # keep some leases un-acked, as between checkpoints
                            q.ack(lease)
                            acked_groups.add(lease.group_id)
                except QueueError:
                    return

        workers = [threading.Thread(target=produce, args=(k,)) for k in range(3)]
        workers.append(threading.Thread(target=train))
        for t in workers:
            t.start()
        deadline = time.monotonic() + 60
        while (len(put_ok) < 60 or len(acked_groups) < 6) and time.monotonic() < deadline:
            time.sleep(0.05)  # mid-run: enough traffic that the kill lands among puts, takes and acks
        srv.kill9()
        stop.set()
        for t in workers:
            t.join(30)
        assert len(put_ok) > 50 and len(acked_groups) > 5, (len(put_ok), len(acked_groups))

        srv.start()  # same port and directory: Redis replays its AOF
        q = backend.open()
        stored_before = q.stats()
        for eid in put_ok:  # stored: a retried put is a no-op
            group = eid.rsplit("-", 1)[0]
            assert q.put(make_episode(eid, group, n_tokens=512), block=False) is False, eid
        assert stored_before == q.stats()
        assert stored_before.acked_groups >= len(acked_groups)

        acked_after, released = q.recover([])  # the trainer restarts with nothing in its checkpoint
        assert acked_after == 0 and released == stored_before.leased_groups
        again = q.take(10**6)
        returned = {lease.group_id for lease in again}
        assert returned.isdisjoint(acked_groups)  # nothing acked comes back
        assert all(len(lease.episodes) == 2 for lease in again)
        ok = set(put_ok)
        complete = {e[: -len("-1")] for e in ok if e.endswith("-1") and e[:-1] + "0" in ok}
        # A complete group is acked or comes back; the one ack whose reply the kill cut off may
        # have been applied (acked, not in acked_groups) or not (it comes back).
        unacked_reply = stored_before.acked_groups - len(acked_groups)
        assert unacked_reply in (0, 1)
        assert len(complete - returned - acked_groups) == unacked_reply
    finally:
        srv.stop()


def test_a_queue_rides_out_a_redis_restart(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "redis").start()
    try:
        q = RedisBackend(srv.url, retry_s=30).open(group_size=1)
        fill(q, "before", 1)
        srv.kill9()
        result: list[bool] = []
        t = threading.Thread(target=lambda: result.append(q.put(make_episode("during-0", "during"))))
        t.start()
        time.sleep(0.5)
        assert result == []  # waiting for the server, not failing
        srv.start()
        t.join(30)
        assert result == [True]
        assert {lease.group_id for lease in q.take(5)} == {"before", "during"}
    finally:
        srv.stop()


def test_unreachable_redis_is_a_queue_error_naming_it(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "redis")  # never started: nothing listens on its port
    with pytest.raises(QueueError, match=f"127.0.0.1:{srv.port}.*(refused|connect)"):
        RedisReplayQueue(srv.url, prefix="x", group_size=2, retry_s=0.3)


def test_a_server_without_aof_is_refused(server: RedisServer) -> None:
    admin = redis.Redis.from_url(server.url)
    admin.config_set("appendonly", "no")
    try:
        with pytest.raises(QueueError, match="append-only file"):
            RedisReplayQueue(server.url, prefix="no-aof", group_size=2)
        q = RedisReplayQueue(server.url, prefix="no-aof", group_size=2, require_aof=False)
        assert q.group_size == 2
    finally:
        admin.config_set("appendonly", "yes")  # starts an AOF rewrite: wait for it, as a shutdown would
        while (
            admin.info("persistence")["aof_rewrite_in_progress"]
            or not admin.info("persistence")["aof_enabled"]
        ):
            time.sleep(0.02)
        admin.close()


def test_a_server_that_fsyncs_lazily_is_warned_about(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis.Redis.from_url(server.url)
    try:
        with caplog.at_level(logging.WARNING, logger="miles_env.queue.redis"):
            RedisBackend(server.url).open(group_size=1)  # the fixture's server: appendfsync always
            assert caplog.records == []
            admin.config_set("appendfsync", "everysec")
            RedisBackend(server.url).open(group_size=1)
        (record,) = caplog.records
        assert "appendfsync everysec" in record.getMessage() and "always" in record.getMessage()
    finally:
        admin.config_set("appendfsync", "always")
        admin.close()


def test_acked_and_stale_payloads_leave_redis_memory_ids_stay(server: RedisServer) -> None:
    backend = RedisBackend(server.url)
    q = backend.open(group_size=1)
    fill(q, "done", 1, version=5)
    fill(q, "old", 1, version=0)
    fill(q, "kept", 1, version=5)
    (lease,) = q.take(1, current_version=5, max_staleness=1)
    assert lease.group_id == "done" and q.stats().stale_groups == 1
    q.ack(lease)
    raw = redis.Redis.from_url(server.url)
    fields = {g: set(raw.hkeys(f"{{{backend.prefix}}}:e:{g}-0")) for g in ("done", "old")}
    raw.close()
    assert fields == {"done": {b"g", b"seq"}, "old": {b"g", b"seq"}}
    assert not q.put(make_episode("done-0", "done"), block=False)  # the id is still known
    assert q.recover(["done-0", "old-0"]) == (1, 0)  # a stale group a checkpoint trained: acked


def test_queues_under_different_prefixes_do_not_mix(server: RedisServer) -> None:
    a = RedisBackend(server.url).open(group_size=1)
    b = RedisBackend(server.url).open(group_size=3)
    fill(a, "x", 1)
    assert b.take(5) == [] and b.stats().open_groups == 0
    assert [lease.group_id for lease in a.take(5)] == ["x"]
    with pytest.raises(QueueError, match="braces"):
        RedisReplayQueue(server.url, prefix="a{b}", group_size=1)


# -- the backend config --------------------------------------------------------------------------


def test_build_queue_opens_each_configured_backend(server: RedisServer, tmp_path: Path) -> None:
    adapter: TypeAdapter[SqliteQueueConfig | RedisQueueConfig] = TypeAdapter(QueueConfig)
    run_dir = tmp_path / "run-42"
    run_dir.mkdir()
    sqlite_cfg = adapter.validate_python({"kind": "sqlite"})
    q: ReplayQueue = build_queue(sqlite_cfg, run_dir, group_size=2, max_pending_groups=4)
    assert isinstance(q, SqliteReplayQueue) and q.path == run_dir / "queue.db"
    q.close()
    redis_cfg = adapter.validate_python({"kind": "redis", "url": server.url})
    q = build_queue(redis_cfg, run_dir, group_size=2, max_pending_groups=4)
    assert isinstance(q, RedisReplayQueue) and q.prefix == "miles-env:run-42" and q.max_pending_groups == 4
    fill(q, "g", 2)
    q.close()
    reopened = build_queue(redis_cfg, run_dir, group_size=None, max_pending_groups=4)  # a resumed run
    assert reopened.group_size == 2 and reopened.stats().pending_groups == 1
    with pytest.raises(ValidationError, match="urll"):
        adapter.validate_python({"kind": "redis", "urll": "redis://x"})
    with pytest.raises(ValidationError, match="kind"):
        adapter.validate_python({"kind": "kafka"})
