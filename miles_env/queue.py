"""Durable replay queue: episodes in, leased GRPO groups out (SQLite, WAL).

Concept: rollout workers `put` episodes; a group (the episodes of one task
sampled together, sharing `group_id`) becomes *pending* once `group_size`
episodes arrived. The trainer `take`s pending groups under a lease, trains on
them, and `ack`s them once the model state that saw them is durable (a
checkpoint). `release` or lease expiry returns a group to pending.

Invariants: an episode id is stored once (a retried `put` is a no-op); a group
is never returned while leased or after it is acked; a group whose oldest weight
version is older than `current_version - max_staleness` is dropped as stale
(counted, never returned). Every state change is one SQLite transaction, so a
crash of either side loses nothing that was committed.

Crash recipe (see trainer/loop.py): the trainer records the episode ids of each
step in its checkpoint and acks only after the checkpoint is durable; on restart
`recover(trained_ids)` acks what the checkpoint already contains and releases
every other lease, so nothing is lost and nothing is trained twice.

Lifecycle of a group: open -> pending -> leased -> acked, with leased -> pending
(release, expiry, recover) and pending -> stale (staleness filter).

One implementation: the synchronous, thread-safe methods below (one SQLite
connection per thread; several processes may share the file). `AsyncReplayQueue`
is a thin anyio wrapper for the async orchestrator and trainer loop.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
from pydantic import BaseModel, ConfigDict

from miles_env.errors import MilesEnvError
from miles_env.types import Episode, Trajectory, Turn

__all__ = ["QueueError", "Lease", "QueueStats", "SqliteReplayQueue", "AsyncReplayQueue", "GroupState"]

_POLL_S = 0.05


class QueueError(MilesEnvError):
    """The replay queue refused an operation (bad group, unknown lease, wrong group_size)."""


class GroupState:
    OPEN = "open"  # fewer than group_size episodes so far
    PENDING = "pending"  # complete, waiting for the trainer
    LEASED = "leased"
    ACKED = "acked"
    STALE = "stale"


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    group_id: str
    episodes: tuple[Episode, ...]
    expires_at: float

    @property
    def episode_ids(self) -> list[str]:
        return [e.id for e in self.episodes]


class QueueStats(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    group_size: int
    max_pending_groups: int
    open_groups: int
    pending_groups: int
    leased_groups: int
    acked_groups: int
    stale_groups: int
    complete_groups: int
    episodes: dict[str, int]  # group state -> number of episodes
    stale_dropped_episodes: int


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    group_id TEXT PRIMARY KEY,
    n INTEGER NOT NULL,
    min_version INTEGER NOT NULL,
    state TEXT NOT NULL,
    lease_id TEXT,
    lease_expires REAL,
    completed_at REAL
);
CREATE INDEX IF NOT EXISTS groups_state ON groups (state, completed_at);
CREATE INDEX IF NOT EXISTS groups_lease ON groups (lease_id);
CREATE TABLE IF NOT EXISTS episodes (
    id TEXT PRIMARY KEY,
    group_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    meta TEXT NOT NULL,
    arrays BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS episodes_group ON episodes (group_id, seq);
"""

_TOKEN_FIELDS = {"token_ids", "loss_mask", "logprobs"}


def encode_episode(episode: Episode) -> tuple[str, bytes]:
    """Episode -> (JSON metadata, packed token arrays). Token ids int32, mask uint8, logprobs float64
    (lossless: the rollout logprobs are the importance-sampling reference)."""
    meta = episode.model_dump(mode="json", exclude={"samples"})
    meta["samples"] = [s.model_dump(mode="json", exclude=_TOKEN_FIELDS) for s in episode.samples]
    meta["lens"] = [len(s.token_ids) for s in episode.samples]
    parts: list[bytes] = []
    for s in episode.samples:
        parts.append(array("i", s.token_ids).tobytes())
        parts.append(bytes(s.loss_mask))
        parts.append(array("d", s.logprobs).tobytes())
    return json.dumps(meta, separators=(",", ":")), b"".join(parts)


def decode_episode(meta_json: str, blob: bytes) -> Episode:
    """Inverse of encode_episode. The data was validated at `put`, so it is rebuilt without
    re-running the per-token validators (they dominate decode time for long trajectories)."""
    meta = json.loads(meta_json)
    lens = meta.pop("lens")
    samples = []
    off = 0
    for sm, n in zip(meta.pop("samples"), lens, strict=True):
        ids = array("i")
        ids.frombytes(blob[off : off + 4 * n])
        off += 4 * n
        mask = list(blob[off : off + n])
        off += n
        lps = array("d")
        lps.frombytes(blob[off : off + 8 * n])
        off += 8 * n
        turns = [Turn.model_validate(t) for t in sm.pop("turns")]
        samples.append(
            Trajectory.model_construct(
                token_ids=ids.tolist(), loss_mask=mask, logprobs=lps.tolist(), turns=turns, **sm
            )
        )
    return Episode.model_validate({**meta, "samples": []}).model_copy(update={"samples": samples})


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
        self._synchronous = synchronous
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = self._conn()
        conn.executescript(_SCHEMA)
        self.group_size = self._init_group_size(conn, group_size)

    # -- connection and transactions -------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={self._synchronous}")
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def _write(self) -> _Tx:
        return _Tx(self._conn())

    def _init_group_size(self, conn: sqlite3.Connection, group_size: int | None) -> int:
        with self._write():
            row = conn.execute("SELECT value FROM meta WHERE key='group_size'").fetchone()
            if row is None:
                if group_size is None:
                    raise QueueError(f"{self.path}: new queue database needs group_size")
                if group_size < 1:
                    raise QueueError(f"group_size={group_size}: must be >= 1")
                conn.execute("INSERT INTO meta VALUES ('group_size', ?)", (str(group_size),))
                conn.execute("INSERT INTO meta VALUES ('stale_dropped', '0')")
                return group_size
        stored = int(row[0])
        if group_size is not None and group_size != stored:
            raise QueueError(f"group_size={group_size} but {self.path} was created with group_size={stored}")
        return stored

    def close(self) -> None:
        with self._conns_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        self._local = threading.local()

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
                "SELECT n, min_version, state FROM groups WHERE group_id=?", (episode.group_id,)
            ).fetchone()
            n, min_v = (0, episode.min_weight_version) if row is None else (row[0], row[1])
            if row is not None and row[2] != GroupState.OPEN:
                raise QueueError(
                    f"episode {episode.id!r}: group {episode.group_id!r} already has group_size="
                    f"{self.group_size} episodes"
                )
            n += 1
            min_v = min(min_v, episode.min_weight_version)
            state = GroupState.PENDING if n == self.group_size else GroupState.OPEN
            done_at = time.time() if state == GroupState.PENDING else None
            conn.execute(
                "INSERT INTO episodes VALUES (?, ?, ?, ?, ?)", (episode.id, episode.group_id, n, meta, blob)
            )
            conn.execute(
                "INSERT INTO groups (group_id, n, min_version, state, completed_at) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT(group_id) DO UPDATE SET n=excluded.n, min_version=excluded.min_version, "
                "state=excluded.state, completed_at=excluded.completed_at",
                (episode.group_id, n, min_v, state, done_at),
            )
        return True

    def has_capacity(self) -> bool:
        row = (
            self._conn()
            .execute("SELECT COUNT(*) FROM groups WHERE state=?", (GroupState.PENDING,))
            .fetchone()
        )
        return int(row[0]) < self.max_pending_groups

    def wait_for_capacity(self, timeout: float | None = None) -> bool:
        """Block while max_pending_groups complete groups are waiting; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.has_capacity():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    # -- consumer side ---------------------------------------------------------------------------

    def take(
        self,
        n_groups: int,
        *,
        current_version: int = 0,
        max_staleness: int | None = None,
        lease_s: float = 600.0,
    ) -> list[Lease]:
        """Lease up to `n_groups` pending groups, oldest completed first (may return fewer)."""
        conn = self._conn()
        now = time.time()
        with self._write():
            self._expire(conn, now)
            if max_staleness is not None:
                self._drop_stale(conn, current_version - max_staleness)
            rows = conn.execute(
                "SELECT group_id FROM groups WHERE state=? ORDER BY completed_at, group_id LIMIT ?",
                (GroupState.PENDING, n_groups),
            ).fetchall()
            leases = []
            for (group_id,) in rows:
                lease_id = uuid.uuid4().hex
                conn.execute(
                    "UPDATE groups SET state=?, lease_id=?, lease_expires=? WHERE group_id=?",
                    (GroupState.LEASED, lease_id, now + lease_s, group_id),
                )
                episodes = conn.execute(
                    "SELECT meta, arrays FROM episodes WHERE group_id=? ORDER BY seq", (group_id,)
                ).fetchall()
                leases.append(
                    Lease(lease_id, group_id, tuple(decode_episode(m, b) for m, b in episodes), now + lease_s)
                )
        return leases

    def _expire(self, conn: sqlite3.Connection, now: float) -> None:
        conn.execute(
            "UPDATE groups SET state=?, lease_id=NULL, lease_expires=NULL WHERE state=? AND lease_expires<?",
            (GroupState.PENDING, GroupState.LEASED, now),
        )

    def _drop_stale(self, conn: sqlite3.Connection, oldest_ok: int) -> None:
        n = conn.execute(
            "SELECT COALESCE(SUM(n), 0) FROM groups WHERE state=? AND min_version<?",
            (GroupState.PENDING, oldest_ok),
        ).fetchone()[0]
        if n:
            conn.execute(
                "UPDATE groups SET state=? WHERE state=? AND min_version<?",
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

    def stats(self) -> QueueStats:
        conn = self._conn()
        groups = dict.fromkeys(
            (GroupState.OPEN, GroupState.PENDING, GroupState.LEASED, GroupState.ACKED, GroupState.STALE), 0
        )
        episodes = dict(groups)
        for state, n_groups, n_eps in conn.execute(
            "SELECT state, COUNT(*), SUM(n) FROM groups GROUP BY state"
        ):
            groups[state] = int(n_groups)
            episodes[state] = int(n_eps)
        dropped = conn.execute("SELECT value FROM meta WHERE key='stale_dropped'").fetchone()
        return QueueStats(
            group_size=self.group_size,
            max_pending_groups=self.max_pending_groups,
            open_groups=groups[GroupState.OPEN],
            pending_groups=groups[GroupState.PENDING],
            leased_groups=groups[GroupState.LEASED],
            acked_groups=groups[GroupState.ACKED],
            stale_groups=groups[GroupState.STALE],
            complete_groups=sum(v for k, v in groups.items() if k != GroupState.OPEN),
            episodes=episodes,
            stale_dropped_episodes=int(dropped[0]) if dropped else 0,
        )

    @property
    def aio(self) -> AsyncReplayQueue:
        return AsyncReplayQueue(self)


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT: takes the write lock up front, so concurrent writers queue on
    busy_timeout instead of deadlocking on a read->write upgrade."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self._conn.execute("BEGIN IMMEDIATE")
        return self._conn

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._conn.execute("COMMIT" if exc_type is None else "ROLLBACK")


class AsyncReplayQueue:
    """anyio face of SqliteReplayQueue: each call runs the sync method in a worker thread; waiting
    for capacity polls with anyio.sleep so a blocked producer holds no thread."""

    def __init__(self, queue: SqliteReplayQueue) -> None:
        self.sync = queue

    async def wait_for_capacity(self) -> None:
        # Polling, not an Event: the consumer that frees capacity may be another process.
        while not await anyio.to_thread.run_sync(self.sync.has_capacity):  # noqa: ASYNC110
            await anyio.sleep(_POLL_S)

    async def put(self, episode: Episode) -> bool:
        await self.wait_for_capacity()
        return await anyio.to_thread.run_sync(lambda: self.sync.put(episode, block=False))

    async def take(
        self,
        n_groups: int,
        *,
        current_version: int = 0,
        max_staleness: int | None = None,
        lease_s: float = 600.0,
    ) -> list[Lease]:
        return await anyio.to_thread.run_sync(
            lambda: self.sync.take(
                n_groups, current_version=current_version, max_staleness=max_staleness, lease_s=lease_s
            )
        )

    async def ack(self, leases: Lease | Sequence[Lease]) -> None:
        await anyio.to_thread.run_sync(self.sync.ack, leases)

    async def release(self, leases: Lease | Sequence[Lease]) -> None:
        await anyio.to_thread.run_sync(self.sync.release, leases)

    async def renew(self, leases: Lease | Sequence[Lease], lease_s: float) -> None:
        await anyio.to_thread.run_sync(self.sync.renew, leases, lease_s)

    async def recover(self, trained_episode_ids: Iterable[str]) -> tuple[int, int]:
        ids = list(trained_episode_ids)
        return await anyio.to_thread.run_sync(self.sync.recover, ids)

    async def stats(self) -> QueueStats:
        return await anyio.to_thread.run_sync(self.sync.stats)
