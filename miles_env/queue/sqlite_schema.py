"""The SQLite replay queue's tables, and what opening a database does to them.

Concept: four tables: `meta` (group_size, the stale-dropped counter), `groups` (one row per GRPO
group: its episode count, oldest and newest sampled weight version, state and lease), `episodes` (each episode's JSON
metadata, packed token arrays and sha256, codec.py) and `quarantine` (episodes whose bytes failed
their checksum). `open_schema` creates what is missing, migrates older databases and settles the
group size, each in one write transaction.

Invariant: a database keeps the group size it was created with; opening it with another is a
QueueError naming both. Databases from before the checksum column gain it on open, and the rows
that may still be trained (open, pending, leased) get the checksum of their bytes as found;
acked and stale rows are never read again, so they are left alone. Databases from before
`max_version` (the newest sampled version: a group is stale only when even that is too old) gain
it on open, set to the group's `min_version` (what decided its staleness then).
"""

from __future__ import annotations

from miles_env.queue.codec import payload_checksum
from miles_env.queue.contract import GroupState, QueueError
from miles_env.queue.sqlite_db import SqliteFile

__all__ = ["open_schema"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    group_id TEXT PRIMARY KEY,
    n INTEGER NOT NULL,
    min_version INTEGER NOT NULL,
    max_version INTEGER,
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
    arrays BLOB NOT NULL,
    checksum TEXT
);
CREATE INDEX IF NOT EXISTS episodes_group ON episodes (group_id, seq);
CREATE TABLE IF NOT EXISTS quarantine (
    episode_id TEXT PRIMARY KEY,
    group_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
"""


def open_schema(db: SqliteFile, group_size: int | None) -> int:
    """Create or migrate `db`'s tables; the group size it holds (a new database stores `group_size`)."""
    with db.errors():
        db.conn().executescript(_SCHEMA)
    _add_checksums(db)
    _add_max_version(db)
    return _init_group_size(db, group_size)


def _add_max_version(db: SqliteFile) -> None:
    with db.write() as conn:
        if any(col[1] == "max_version" for col in conn.execute("PRAGMA table_info(groups)")):
            return
        conn.execute("ALTER TABLE groups ADD COLUMN max_version INTEGER")
        conn.execute("UPDATE groups SET max_version=min_version")


def _add_checksums(db: SqliteFile) -> None:
    """Migrate a database from before the checksum column: add it, and checksum the rows that
    may still be trained (acked and stale ones are never read again)."""
    with db.write() as conn:
        if any(col[1] == "checksum" for col in conn.execute("PRAGMA table_info(episodes)")):
            return
        conn.execute("ALTER TABLE episodes ADD COLUMN checksum TEXT")
        rows = conn.execute(
            "SELECT e.id, CAST(e.meta AS BLOB), e.arrays FROM episodes e JOIN groups g USING (group_id) "
            "WHERE g.state IN (?, ?, ?)",
            (GroupState.OPEN, GroupState.PENDING, GroupState.LEASED),
        ).fetchall()
        conn.executemany(
            "UPDATE episodes SET checksum=? WHERE id=?", [(payload_checksum(m, b), i) for i, m, b in rows]
        )


def _init_group_size(db: SqliteFile, group_size: int | None) -> int:
    with db.write() as conn:
        row = conn.execute("SELECT value FROM meta WHERE key='group_size'").fetchone()
        if row is None:
            if group_size is None:
                raise QueueError(f"{db.path}: new queue database needs group_size")
            if group_size < 1:
                raise QueueError(f"group_size={group_size}: must be >= 1")
            conn.execute("INSERT INTO meta VALUES ('group_size', ?)", (str(group_size),))
            conn.execute("INSERT INTO meta VALUES ('stale_dropped', '0')")
            return group_size
    stored = int(row[0])
    if group_size is not None and group_size != stored:
        raise QueueError(f"group_size={group_size} but {db.path} was created with group_size={stored}")
    return stored
