"""The replay queue on SQLite (WAL): the embedded default backend of contract.py's `ReplayQueue`.

Concept: one file in the run directory holds the groups, their episodes and the quarantine
(sqlite_schema.py); rollout workers `put`, the trainer `take`s under a lease and `ack`s after its
checkpoint (contract.py has the group lifecycle).

Invariants: an episode id is stored once (a retried `put` is a no-op); a group is never returned
while leased or after it is acked; an episode whose weight version is older than
`current_version - max_staleness` is stale: never trained (its lease holds it apart), and a group
whose every sampled episode is stale is dropped (counted, never returned). Every state
change is one SQLite transaction, so a crash of either side loses nothing that was committed.

Integrity: `put` stores a sha256 of each episode's bytes (codec.py); `take` re-checks it. An
episode whose bytes changed at rest (SQLite's integrity check does not look inside a BLOB) is
recorded in the `quarantine` table and its group moves to state quarantined: never trained,
counted in `stats`, logged once. SQLite failures (disk full, not a database) surface as
QueueError carrying SQLite's own message.

Crash recipe (see trainer/loop.py): the trainer records the episode ids of each step in its
checkpoint and acks only after the checkpoint is durable; on restart `recover(trained_ids)` acks
what the checkpoint already contains and releases every other lease, so nothing is lost and
nothing is trained twice.

One implementation: the synchronous, thread-safe methods below (one SQLite connection per thread,
sqlite_db.py; several processes may share the file). `AsyncReplayQueue` (aio.py) is a thin anyio
wrapper for the async orchestrator and trainer loop.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
import uuid
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from miles_env.queue.aio import AsyncReplayQueue
from miles_env.queue.codec import decode_episode, encode_episode, payload_checksum
from miles_env.queue.contract import (
    GroupState,
    Lease,
    OpenGroup,
    QueueError,
    QueueStats,
    group_version,
    newest_version,
    split_stale,
    wait_for_capacity,
)
from miles_env.queue.sqlite_db import SqliteFile
from miles_env.queue.sqlite_schema import open_schema
from miles_env.types import Episode

__all__ = ["SqliteReplayQueue"]

log = logging.getLogger(__name__)


class SqliteReplayQueue:
    """The durable queue. `group_size=None` opens an existing database with its stored group size."""

    def __init__(
        self,
        path: str | Path,
        *,
        group_size: int | None = None,
        max_pending_groups: int = 64,
        synchronous: str = "NORMAL",
    ) -> None:
        if max_pending_groups < 1:
            raise QueueError(f"max_pending_groups={max_pending_groups}: must be >= 1")
        self.path = Path(path)
        self.max_pending_groups = max_pending_groups
        self._db = SqliteFile(self.path, what="replay queue", error=QueueError, synchronous=synchronous)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.group_size = open_schema(self._db, group_size)

    # -- connection and transactions -------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        return self._db.conn()

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:
        return self._db.write()

    def close(self) -> None:
        self._db.close()

    # -- producer side ---------------------------------------------------------------------------

    def put(self, episode: Episode, *, block: bool = True, timeout: float | None = None) -> bool:
        """Store one episode; False if its id was already stored. With `block`, first wait for
        capacity (back-pressure); TimeoutError after `timeout` seconds."""
        if block and not self.wait_for_capacity(timeout):
            raise TimeoutError(f"replay queue {self.path} full for {timeout}s")
        meta, blob = encode_episode(episode)
        conn = self._conn()
        with self._write():
            if conn.execute("SELECT 1 FROM episodes WHERE id=?", (episode.id,)).fetchone():
                return False
            row = conn.execute(
                "SELECT n, min_version, state, max_version FROM groups WHERE group_id=?", (episode.group_id,)
            ).fetchone()
            n, min_v = (0, group_version(episode)) if row is None else (row[0], row[1])
            max_v = newest_version(None if row is None else row[3], episode)
            if row is not None and row[2] != GroupState.OPEN:
                raise QueueError(
                    f"episode {episode.id!r}: group {episode.group_id!r} already has group_size="
                    f"{self.group_size} episodes"
                )
            n += 1
            min_v = min(min_v, group_version(episode))
            state = GroupState.PENDING if n == self.group_size else GroupState.OPEN
            done_at = time.time() if state == GroupState.PENDING else None
            conn.execute(
                "INSERT INTO episodes (id, group_id, seq, meta, arrays, checksum) VALUES (?, ?, ?, ?, ?, ?)",
                (episode.id, episode.group_id, n, meta, blob, payload_checksum(meta, blob)),
            )
            conn.execute(
                "INSERT INTO groups (group_id, n, min_version, max_version, state, completed_at) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(group_id) DO UPDATE SET n=excluded.n, "
                "min_version=excluded.min_version, max_version=excluded.max_version, "
                "state=excluded.state, completed_at=excluded.completed_at",
                (episode.group_id, n, min_v, max_v, state, done_at),
            )
        return True

    def has_capacity(self) -> bool:
        with self._db.errors():
            row = (
                self._conn()
                .execute("SELECT COUNT(*) FROM groups WHERE state=?", (GroupState.PENDING,))
                .fetchone()
            )
        return int(row[0]) < self.max_pending_groups

    def wait_for_capacity(self, timeout: float | None = None) -> bool:
        """Block while max_pending_groups complete groups are waiting; False on timeout."""
        return wait_for_capacity(self, timeout)

    # -- consumer side ---------------------------------------------------------------------------

    def take(
        self,
        n_groups: int,
        *,
        current_version: int = 0,
        max_staleness: int | None = None,
        lease_s: float = 600.0,
    ) -> list[Lease]:
        """Lease up to `n_groups` pending groups, oldest completed first (may return fewer), each with
        its stale episodes apart (contract.py). A group holding an episode whose bytes fail their
        checksum is quarantined instead of returned."""
        conn = self._conn()
        now = time.time()
        leases: list[Lease] = []
        quarantined: list[tuple[str, str, str]] = []
        oldest_ok = None if max_staleness is None else current_version - max_staleness
        with self._write():
            self._expire(conn, now)
            if oldest_ok is not None:
                self._drop_stale(conn, oldest_ok)
            while len(leases) < n_groups:
                rows = conn.execute(
                    "SELECT group_id FROM groups WHERE state=? ORDER BY completed_at, group_id LIMIT ?",
                    (GroupState.PENDING, n_groups - len(leases)),
                ).fetchall()
                if not rows:
                    break
                for (group_id,) in rows:  # each one leaves state pending: the loop ends
                    episodes, bad = self._load_group(conn, group_id)
                    if bad:
                        self._quarantine(conn, group_id, bad, now)
                        quarantined.extend((eid, group_id, why) for eid, why in bad)
                        continue
                    fresh, stale = split_stale(episodes, oldest_ok)
                    lease = Lease(uuid.uuid4().hex, group_id, fresh, now + lease_s, stale)
                    conn.execute(
                        "UPDATE groups SET state=?, lease_id=?, lease_expires=? WHERE group_id=?",
                        (GroupState.LEASED, lease.lease_id, lease.expires_at, group_id),
                    )
                    leases.append(lease)
        for eid, group_id, why in quarantined:  # after the commit: logged once, when it happened
            log.error(
                "replay queue %s: episode %r quarantined with its group %r (%s); it will not be trained",
                self.path,
                eid,
                group_id,
                why,
            )
        return leases

    def _load_group(
        self, conn: sqlite3.Connection, group_id: str
    ) -> tuple[tuple[Episode, ...], list[tuple[str, str]]]:
        """The group's episodes, or the (episode id, reason) of each one that failed its checksum.
        The bytes are read raw, so a corrupted `meta` cannot fail on its way to the check."""
        rows = conn.execute(
            "SELECT id, CAST(meta AS BLOB), arrays, checksum FROM episodes WHERE group_id=? ORDER BY seq",
            (group_id,),
        ).fetchall()
        bad = [
            (eid, "checksum missing" if want is None else "checksum mismatch: stored bytes changed since put")
            for eid, meta, blob, want in rows
            if want is None or payload_checksum(meta, blob) != want
        ]
        if bad:
            return (), bad
        return tuple(decode_episode(meta.decode(), blob) for _, meta, blob, _ in rows), []

    def _quarantine(
        self, conn: sqlite3.Connection, group_id: str, bad: list[tuple[str, str]], now: float
    ) -> None:
        conn.executemany(
            "INSERT OR IGNORE INTO quarantine VALUES (?, ?, ?, ?)",
            [(eid, group_id, why, now) for eid, why in bad],
        )
        conn.execute("UPDATE groups SET state=? WHERE group_id=?", (GroupState.QUARANTINED, group_id))

    def _expire(self, conn: sqlite3.Connection, now: float) -> None:
        conn.execute(
            "UPDATE groups SET state=?, lease_id=NULL, lease_expires=NULL WHERE state=? AND lease_expires<?",
            (GroupState.PENDING, GroupState.LEASED, now),
        )

    def _drop_stale(self, conn: sqlite3.Connection, oldest_ok: int) -> None:
        """Drop the pending groups whose every sampled episode is stale (their newest is too old)."""
        n = conn.execute(
            "SELECT COALESCE(SUM(n), 0) FROM groups WHERE state=? AND max_version<?",
            (GroupState.PENDING, oldest_ok),
        ).fetchone()[0]
        if n:
            conn.execute(
                "UPDATE groups SET state=? WHERE state=? AND max_version<?",
                (GroupState.STALE, GroupState.PENDING, oldest_ok),
            )
            conn.execute(
                "UPDATE meta SET value=CAST(value AS INTEGER)+? WHERE key='stale_dropped'", (int(n),)
            )

    def ack(self, leases: Lease | Sequence[Lease]) -> None:
        """Mark leased groups done; they are never returned again. An expired lease whose group was
        re-leased elsewhere raises QueueError (that group would otherwise be trained twice)."""
        self._finish(leases, GroupState.ACKED)

    def release(self, leases: Lease | Sequence[Lease]) -> None:
        """Return leased groups to pending (for example when a step is abandoned)."""
        self._finish(leases, GroupState.PENDING)

    def renew(self, leases: Lease | Sequence[Lease], lease_s: float) -> None:
        """Extend leases held across several steps (acks wait for the next checkpoint)."""
        items = [leases] if isinstance(leases, Lease) else list(leases)
        conn = self._conn()
        with self._write():
            for lease in items:
                conn.execute(
                    "UPDATE groups SET lease_expires=? WHERE lease_id=? AND state=?",
                    (time.time() + lease_s, lease.lease_id, GroupState.LEASED),
                )

    def _finish(self, leases: Lease | Sequence[Lease], state: str) -> None:
        items = [leases] if isinstance(leases, Lease) else list(leases)
        conn = self._conn()
        with self._write():
            for lease in items:
                row = conn.execute(
                    "SELECT state, lease_id FROM groups WHERE group_id=?", (lease.group_id,)
                ).fetchone()
                if row is None:
                    raise QueueError(f"lease {lease.lease_id}: unknown group {lease.group_id!r}")
                if row[0] == state == GroupState.ACKED:
                    continue
                if row[0] == GroupState.PENDING and state == GroupState.PENDING:
                    continue  # expired already: releasing is a no-op
                expired_unclaimed = (
                    row[0] in (GroupState.PENDING, GroupState.STALE) and state == GroupState.ACKED
                )
                if row[1] != lease.lease_id and not expired_unclaimed:
                    raise QueueError(
                        f"lease {lease.lease_id} on group {lease.group_id!r} is no longer held (state {row[0]})"
                    )
                conn.execute(
                    "UPDATE groups SET state=?, lease_id=NULL, lease_expires=NULL WHERE group_id=?",
                    (state, lease.group_id),
                )

    def recover(self, trained_episode_ids: Iterable[str]) -> tuple[int, int]:
        """After a trainer restart: ack every not-yet-acked group whose episodes the restored
        checkpoint already trained on, release every other lease. Returns (acked, released) groups."""
        trained = set(trained_episode_ids)
        conn = self._conn()
        acked = 0
        with self._write():
            for (group_id,) in conn.execute(
                "SELECT DISTINCT group_id FROM episodes WHERE id IN (SELECT value FROM json_each(?))",
                (json.dumps(sorted(trained)),),
            ).fetchall():
                cur = conn.execute(
                    "UPDATE groups SET state=?, lease_id=NULL, lease_expires=NULL "
                    "WHERE group_id=? AND state IN (?, ?, ?)",
                    (GroupState.ACKED, group_id, GroupState.LEASED, GroupState.PENDING, GroupState.STALE),
                )
                acked += cur.rowcount
            released = conn.execute(
                "UPDATE groups SET state=?, lease_id=NULL, lease_expires=NULL WHERE state=?",
                (GroupState.PENDING, GroupState.LEASED),
            ).rowcount
        return acked, released

    # -- introspection ---------------------------------------------------------------------------

    def open_groups(self) -> list[OpenGroup]:
        """Every open group, by group id, with its task (read from its first episode)."""
        with self._db.errors():
            cursor = self._conn().execute(
                "SELECT g.group_id, json_extract(e.meta, '$.task_id'), g.n FROM groups g JOIN episodes e "
                "ON e.group_id = g.group_id AND e.seq = 1 WHERE g.state=? ORDER BY g.group_id",
                (GroupState.OPEN,),
            )
            rows = cursor.fetchall()
        return [OpenGroup(str(gid), str(task), int(n)) for gid, task, n in rows]

    def stats(self) -> QueueStats:
        conn = self._conn()
        groups = dict.fromkeys(tuple(GroupState), 0)
        episodes = dict(groups)
        with self._db.errors():
            for state, n_groups, n_eps in conn.execute(
                "SELECT state, COUNT(*), SUM(n) FROM groups GROUP BY state"
            ):
                groups[state] = int(n_groups)
                episodes[state] = int(n_eps)
            dropped = conn.execute("SELECT value FROM meta WHERE key='stale_dropped'").fetchone()
            (bad_episodes,) = conn.execute("SELECT COUNT(*) FROM quarantine").fetchone()
        return QueueStats(
            group_size=self.group_size,
            max_pending_groups=self.max_pending_groups,
            open_groups=groups[GroupState.OPEN],
            pending_groups=groups[GroupState.PENDING],
            leased_groups=groups[GroupState.LEASED],
            acked_groups=groups[GroupState.ACKED],
            stale_groups=groups[GroupState.STALE],
            quarantined_groups=groups[GroupState.QUARANTINED],
            complete_groups=sum(v for k, v in groups.items() if k != GroupState.OPEN),
            episodes=episodes,
            stale_dropped_episodes=int(dropped[0]) if dropped else 0,
            quarantined_episodes=int(bad_episodes),
        )

    @property
    def aio(self) -> AsyncReplayQueue:
        return AsyncReplayQueue(self)
