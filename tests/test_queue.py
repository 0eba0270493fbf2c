"""SqliteReplayQueue: the queue contract (tests/queue_contract.py) on SQLite, plus what only SQLite has:
the codec round trip, the stats CLI, checksum migration of old databases, storage faults (not a
database, full database, full disk)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from queue_contract import QueueContract, fill, make_episode
from typer.testing import CliRunner

from miles_env.queue.codec import decode_episode, encode_episode
from miles_env.queue.contract import GroupState, QueueError
from miles_env.queue.sqlite import SqliteReplayQueue
from miles_env.types import RoutedExperts


class SqliteBackend:
    """The contract's view of one SQLite file (tests/queue_contract.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def open(self, *, group_size: int | None = None, max_pending_groups: int = 64) -> SqliteReplayQueue:
        return SqliteReplayQueue(self.path, group_size=group_size, max_pending_groups=max_pending_groups)

    def corrupt(self, episode_id: str, offset: int) -> None:
        _flip_byte(self.path, episode_id, offset)


class TestSqliteContract(QueueContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> SqliteBackend:
        return SqliteBackend(tmp_path / "queue.db")


@pytest.fixture
def qpath(tmp_path: Path) -> Path:
    return tmp_path / "queue.db"


def test_encode_roundtrip_is_exact() -> None:
    ep = make_episode("e", "g", n_tokens=37)
    meta, blob = encode_episode(ep)
    back = decode_episode(meta, blob)
    assert back == ep
    assert back.samples[0].logprobs == ep.samples[0].logprobs  # float64, bit-exact


def test_moe_routing_travels_in_the_blob_only_where_a_sample_has_it() -> None:
    """A sample's routed_experts (tokens x layers x k small ints) is its raw packed ids in the blob,
    its shape in the JSON; a sample without one costs nothing."""
    ep = make_episode("e", "g", n_tokens=12)  # 6 mask-1 tokens per sample
    narrow = RoutedExperts.pack([[[t % 4, 4 + t % 3], [1, 2], [0, 7]] for t in range(6)])
    wide = RoutedExperts.pack([[[t, 300 + t]] for t in range(6)])  # > 256 experts: uint16
    routed = ep.model_copy(update={"samples": [ep.samples[0].model_copy(update={"routed_experts": narrow}),
                                               ep.samples[1].model_copy(update={"routed_experts": wide})]})  # fmt: skip
    plain_meta, plain_blob = encode_episode(ep)
    meta, blob = encode_episode(routed)
    assert len(blob) - len(plain_blob) == 6 * 3 * 2 * 1 + 6 * 1 * 2 * 2
    assert narrow.data not in meta and "routed_experts" not in plain_meta
    back = decode_episode(meta, blob)
    assert back == routed and back.samples[1].routed_experts.rows() == wide.rows()  # type: ignore[union-attr]
    assert decode_episode(plain_meta, plain_blob).samples[0].routed_experts is None


def test_group_states_are_stored_as_their_plain_strings(qpath: Path) -> None:
    """GroupState is a StrEnum: the values databases already hold, written and read back as text."""
    assert [s.value for s in GroupState] == ["open", "pending", "leased", "acked", "stale", "quarantined"]
    q = SqliteReplayQueue(qpath, group_size=2)
    fill(q, "a", 2)
    fill(q, "b", 1)
    with sqlite3.connect(qpath) as conn:
        rows = dict(conn.execute("SELECT state, typeof(state) FROM groups"))
    assert rows == {"pending": "text", "open": "text"}
    idle = dict.fromkeys(["leased", "acked", "stale", "quarantined"], 0)
    assert q.stats().episodes == {"open": 1, "pending": 2, **idle}


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


def test_quarantine_shows_in_cli_stats(qpath: Path) -> None:
    q = SqliteReplayQueue(qpath, group_size=2)
    fill(q, "bad", 2)
    _flip_byte(qpath, "bad-1", offset=-3)
    assert q.take(10) == []
    from miles_env.cli.queue import app

    res = CliRunner().invoke(app, ["stats", str(qpath), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["quarantined_episodes"] == 1


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


def test_database_without_max_version_is_judged_by_min_version(qpath: Path) -> None:
    """A group stored before per-episode staleness keeps the whole-group rule it was put under."""
    q = SqliteReplayQueue(qpath, group_size=2)
    q.put(make_episode("mix-0", "mix", version=5), block=False)
    q.put(make_episode("mix-1", "mix", version=1), block=False)
    q.close()
    raw = sqlite3.connect(qpath)
    raw.execute("ALTER TABLE groups DROP COLUMN max_version")
    raw.commit()
    raw.close()
    q = SqliteReplayQueue(qpath)
    assert q.take(10, current_version=5, max_staleness=2) == [] and q.stats().stale_groups == 1


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
