"""One SQLite file shared by threads and processes: a connection per thread, write transactions
that take the lock up front, and failures reported with SQLite's own message.

Concept: `SqliteFile(path, error=...)` hands each thread its own connection (WAL, autocommit
mode, so transactions are explicit) and `write()` is one `BEGIN IMMEDIATE ... COMMIT`. Every
`sqlite3.Error` leaving `errors()` or `write()` becomes the owner's error type (a QueueError
for the replay queue) whose message is "<what> <path>: <SQLite's message>".

Invariant: the error reported is the one that happened. On SQLITE_FULL and some I/O errors
SQLite rolls the transaction back by itself; a blind ROLLBACK would then fail with "cannot
rollback - no transaction is active" and hide "database or disk is full".
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["SqliteFile"]


class SqliteFile:
    def __init__(self, path: Path, *, what: str, error: Callable[[str], Exception], synchronous: str) -> None:
        self.path = path
        self._what = what
        self._error = error
        self._synchronous = synchronous
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Translate a sqlite3.Error raised inside into the owner's error type."""
        try:
            yield
        except sqlite3.Error as e:
            raise self._translate(e) from e

    def _translate(self, e: sqlite3.Error) -> Exception:
        return self._error(f"{self._what} {self.path}: {e}")

    def conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            with self.errors():
                conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None, check_same_thread=False)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(f"PRAGMA synchronous={self._synchronous}")
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def write(self) -> _Tx:
        return _Tx(self.conn(), self)

    def close(self) -> None:
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        self._local = threading.local()


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT: takes the write lock up front, so concurrent writers queue on
    busy_timeout instead of deadlocking on a read->write upgrade."""

    def __init__(self, conn: sqlite3.Connection, db: SqliteFile) -> None:
        self._conn = conn
        self._db = db

    def __enter__(self) -> sqlite3.Connection:
        with self._db.errors():
            self._conn.execute("BEGIN IMMEDIATE")
        return self._conn

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            try:
                self._conn.execute("COMMIT")
            except sqlite3.Error as e:
                self._rollback()
                raise self._db._translate(e) from e
            return
        self._rollback()
        if isinstance(exc, sqlite3.Error):
            raise self._db._translate(exc) from exc

    def _rollback(self) -> None:
        if not self._conn.in_transaction:
            return  # SQLite already rolled back (SQLITE_FULL, I/O error)
        try:
            self._conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # the error already on its way out is the one to report
