"""SqliteReplayQueue: durability, grouping, leases, staleness, back-pressure, concurrency, CLI."""

from __future__ import annotations

import json
import logging
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from typer.testing import CliRunner

from miles_env.queue import QueueError, SqliteReplayQueue, decode_episode, encode_episode
from miles_env.types import Episode, Reward, Status, Trajectory, Turn


def make_episode(eid: str, group: str, *, version: int = 0, score: float = 1.0, n_tokens: int = 8) -> Episode:
    ids = list(range(100, 100 + n_tokens))
    mask = [0] * (n_tokens // 2) + [1] * (n_tokens - n_tokens // 2)
    lps = [0.0 if m == 0 else -0.1 * (i + 1) - 1e-9 * i for i, m in enumerate(mask)]
    traj = Trajectory(
        token_ids=ids,
        loss_mask=mask,
        logprobs=lps,
        turns=[
            Turn(
                start=n_tokens // 2,
                prompt_len=n_tokens // 2,
                completion_len=n_tokens // 2,
                finish_reason="stop",
                weight_version=version,
            )
        ],
    )
    return Episode(
        id=eid,
        task_id="t-" + group,
        env="toy",
        group_id=group,
        status=Status.COMPLETED,
        reward=Reward(score=score, details={"k": "v"}),
        samples=[traj, traj.model_copy(update={"branch": 1})],
        metadata={"x": [1, 2]},
    )


def fill(q: SqliteReplayQueue, group: str, n: int, **kw) -> list[Episode]:
    eps = [make_episode(f"{group}-{i}", group, **kw) for i in range(n)]
    for e in eps:
        assert q.put(e, block=False)
    return eps


@pytest.fixture
def qpath(tmp_path: Path) -> Path:
    return tmp_path / "queue.db"


def test_encode_roundtrip_is_exact() -> None:
    ep = make_episode("e", "g", n_tokens=37)
    meta, blob = encode_episode(ep)
    back = decode_episode(meta, blob)
    assert back == ep
    assert back.samples[0].logprobs == ep.samples[0].logprobs  # float64, bit-exact


def test_group_complete_only_at_group_size(qpath: Path) -> None:
    q = SqliteReplayQueue(qpath, group_size=3)
    fill(q, "g", 2)
    assert q.take(5) == []
    assert q.stats().open_groups == 1
    q.put(make_episode("g-2", "g"), block=False)
    (lease,) = q.take(5)
    assert sorted(lease.episode_ids) == ["g-0", "g-1", "g-2"]
    with pytest.raises(QueueError, match="already has group_size=3"):
        q.put(make_episode("g-3", "g"), block=False)


def test_duplicate_put_is_noop(qpath: Path) -> None:
    q = SqliteReplayQueue(qpath, group_size=2)
    e = make_episode("a", "g")
    assert q.put(e, block=False)
    assert not q.put(e, block=False)
    assert q.stats().episodes["open"] == 1


def test_durable_across_reopen(qpath: Path) -> None:
    q = SqliteReplayQueue(qpath, group_size=2)
    eps = fill(q, "g1", 2) + fill(q, "g2", 1)
    (lease,) = q.take(1, lease_s=60)
    q.close()
    q2 = SqliteReplayQueue(qpath)  # group_size read back from the database
    assert q2.group_size == 2
    s = q2.stats()
    assert (s.leased_groups, s.open_groups, s.pending_groups) == (1, 1, 0)
    q2.release(lease)
    (again,) = q2.take(1)
    assert list(again.episodes) == eps[:2]
    with pytest.raises(QueueError, match="group_size=3"):
        SqliteReplayQueue(qpath, group_size=3)


def test_ack_release_and_expiry(qpath: Path) -> None:
    q = SqliteReplayQueue(qpath, group_size=1)
    fill(q, "a", 1)
    fill(q, "b", 1)
    la, lb = q.take(2, lease_s=60)
    assert q.take(2) == []  # both leased
    q.ack(la)
    q.release(lb)
    (lb2,) = q.take(2, lease_s=0.05)
    assert lb2.group_id == "b" and lb2.lease_id != lb.lease_id
    with pytest.raises(QueueError, match="no longer held"):
        q.ack(lb)  # the old lease is void
    time.sleep(0.1)
    (lb3,) = q.take(2, lease_s=60)  # expired lease returned automatically
    assert lb3.group_id == "b"
    q.ack(lb3)
    assert q.take(2) == []
    s = q.stats()
    assert s.acked_groups == 2 and s.leased_groups == 0 and s.complete_groups == 2


def test_staleness_filter_drops_and_counts(qpath: Path) -> None:
    q = SqliteReplayQueue(qpath, group_size=2)
    fill(q, "old", 2, version=1)
    q.put(make_episode("mix-0", "mix", version=5), block=False)
    q.put(make_episode("mix-1", "mix", version=2), block=False)  # group min version = 2
    fill(q, "new", 2, version=5)
    leases = q.take(10, current_version=5, max_staleness=2)
    assert [lease.group_id for lease in leases] == ["new"]
    s = q.stats()
    assert s.stale_groups == 2 and s.stale_dropped_episodes == 4
    assert q.take(10, current_version=5, max_staleness=None) == []  # stale groups never return


def test_back_pressure_blocks_until_taken(qpath: Path) -> None:
    q = SqliteReplayQueue(qpath, group_size=1, max_pending_groups=2)
    fill(q, "a", 1)
    fill(q, "b", 1)
    assert not q.has_capacity()
    with pytest.raises(TimeoutError):
        q.put(make_episode("c-0", "c"), timeout=0.1)
    done = threading.Event()

    def producer() -> None:
        q.put(make_episode("c-0", "c"))
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.2)
    assert not done.is_set()
    q.take(1)
    assert done.wait(5)
    t.join()


def test_async_put_waits_for_capacity(qpath: Path) -> None:
    q = SqliteReplayQueue(qpath, group_size=1, max_pending_groups=1).aio

    async def main() -> list[str]:
        order: list[str] = []
        await q.put(make_episode("a-0", "a"))

        async def produce() -> None:
            await q.put(make_episode("b-0", "b"))
            order.append("put")

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            await anyio.sleep(0.2)
            order.append("take")
            await q.take(1)
        return order

    assert anyio.run(main) == ["take", "put"]


def test_concurrent_put_take_from_threads(qpath: Path) -> None:
    q = SqliteReplayQueue(qpath, group_size=4, max_pending_groups=8)
    n_groups, producers = 40, 4
    seen: list[str] = []

    def produce(k: int) -> None:
        for g in range(k, n_groups, producers):
            for i in range(4):
                q.put(make_episode(f"g{g}-{i}", f"g{g}"))

    def consume() -> None:
        while len(seen) < n_groups * 4:
            for lease in q.take(3):
                seen.extend(lease.episode_ids)
                q.ack(lease)
            time.sleep(0.001)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
    threads.append(threading.Thread(target=consume))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(seen) == len(set(seen)) == n_groups * 4
    assert q.stats().acked_groups == n_groups


def test_recover_acks_trained_and_releases_rest(qpath: Path) -> None:
    q = SqliteReplayQueue(qpath, group_size=2)
    fill(q, "a", 2)
    fill(q, "b", 2)
    fill(q, "c", 2)
    la, lb = q.take(2, lease_s=0.01)
    time.sleep(0.05)  # a's lease expires: a trained group must still be acked, not re-trained
    q.close()
    q = SqliteReplayQueue(qpath)
    acked, released = q.recover(la.episode_ids)
    assert acked == 1
    got = {lease.group_id for lease in q.take(10)}
    assert got == {"b", "c"}


def test_cli_stats(qpath: Path) -> None:
    from miles_env.cli.queue import app

    q = SqliteReplayQueue(qpath, group_size=2)
    fill(q, "a", 2)
    fill(q, "b", 1)
    runner = CliRunner()
    res = runner.invoke(app, ["stats", str(qpath.parent), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["pending_groups"] == 1 and data["open_groups"] == 1 and data["episodes"]["open"] == 1
    res = runner.invoke(app, ["stats", str(qpath.parent)])
    assert res.exit_code == 0 and "pending" in res.output
    res = runner.invoke(app, ["stats", str(qpath.parent / "nope")])
    assert res.exit_code != 0


# -- integrity and storage faults (issue 15) ------------------------------------------------------


def _flip_byte(qpath: Path, episode_id: str, offset: int) -> None:
    """Corrupt one byte of a stored episode behind the queue's back (what a bad disk does)."""
    raw = sqlite3.connect(qpath)
    with raw:
        (blob,) = raw.execute("SELECT arrays FROM episodes WHERE id=?", (episode_id,)).fetchone()
        bad = bytearray(blob)
        bad[offset] ^= 0x01
        raw.execute("UPDATE episodes SET arrays=? WHERE id=?", (bytes(bad), episode_id))
    assert raw.execute("PRAGMA integrity_check").fetchone() == ("ok",)  # SQLite sees nothing wrong
    raw.close()


def test_corrupted_episode_is_quarantined_never_returned(
    qpath: Path, caplog: pytest.LogCaptureFixture
) -> None:
    q = SqliteReplayQueue(qpath, group_size=2)
    fill(q, "bad", 2)
    good = fill(q, "good", 2)
    _flip_byte(qpath, "bad-1", offset=-3)  # inside the last logprob: decodes fine, silently changed
    with caplog.at_level(logging.ERROR, logger="miles_env.queue"):
        leases = q.take(10)
        assert q.take(10) == []
    assert [lease.group_id for lease in leases] == ["good"]
    assert list(leases[0].episodes) == good
    s = q.stats()
    assert (s.quarantined_groups, s.quarantined_episodes, s.pending_groups) == (1, 1, 0)
    logged = [r for r in caplog.records if "bad-1" in r.getMessage()]
    assert len(logged) == 1 and "checksum" in logged[0].getMessage()
    from miles_env.cli.queue import app

    res = CliRunner().invoke(app, ["stats", str(qpath), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["quarantined_episodes"] == 1
    q.close()
    reopened = SqliteReplayQueue(qpath)  # the quarantine is durable
    assert reopened.take(10) == [] and reopened.stats().quarantined_episodes == 1


def test_database_without_checksums_is_migrated(qpath: Path) -> None:
    q = SqliteReplayQueue(qpath, group_size=1)
    eps = fill(q, "old", 1)
    q.close()
    raw = sqlite3.connect(qpath)
    raw.execute("ALTER TABLE episodes DROP COLUMN checksum")  # what a database from before issue 15 holds
    raw.commit()
    raw.close()
    q = SqliteReplayQueue(qpath)
    fill(q, "new", 1)
    q.close()
    _flip_byte(qpath, "new-0", offset=0)
    q = SqliteReplayQueue(qpath)
    (lease,) = q.take(10)
    assert list(lease.episodes) == eps and q.stats().quarantined_episodes == 1


def test_not_a_database_is_a_queue_error(tmp_path: Path) -> None:
    path = tmp_path / "queue.db"
    path.write_text("not sqlite at all, just text long enough to have a header" * 10)
    with pytest.raises(QueueError, match="file is not a database"):
        SqliteReplayQueue(path)


def _fill_until_full(q: SqliteReplayQueue) -> QueueError:
    big = 200_000  # tokens: an episode larger than SQLite's page cache, so the write spills mid-statement
    for i in range(50):
        try:
            q.put(make_episode(f"e{i}", f"g{i}", n_tokens=big), block=False)
        except QueueError as e:
            return e
    raise AssertionError("the queue never filled up")


def test_full_database_names_the_real_error(qpath: Path) -> None:
    """SQLite's page limit stands in for a full disk (SQLITE_FULL either way)."""
    q = SqliteReplayQueue(qpath, group_size=1)
    conn = q._conn()
    conn.execute(f"PRAGMA max_page_count={conn.execute('PRAGMA page_count').fetchone()[0] + 4}")
    err = _fill_until_full(q)
    assert "full" in str(err) and "no transaction" not in str(err)
    assert q.stats().pending_groups == 0  # nothing half-written


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"a tmpfs mount needs root: {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_names_the_real_error(tiny_tmpfs: Path) -> None:
    q = SqliteReplayQueue(tiny_tmpfs / "queue.db", group_size=1)
    err = _fill_until_full(q)
    assert "full" in str(err) and "no transaction" not in str(err)
    q.close()
